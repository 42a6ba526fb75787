"""What the engine checks of a request before it queues it (Engine.add_request): the prompt's token ids,
the token ids its params name, and that prompt + max_tokens fits the context and the KV pool.

Every check raises ValueError naming the field, the limit and the fix; none changes engine state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchinfer.engine.core.block_manager import cdiv
from batchinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchinfer.engine.core.tokenizer import TextTokenizer


def prompt_token_ids(
    tokenizer: TextTokenizer, prompt: object, *, vocab_size: int, add_special_tokens: bool
) -> list[int]:
    """Token ids of a prompt given as text or ids (ids are checked against the vocabulary)."""
    if isinstance(prompt, str):
        token_ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    elif isinstance(prompt, list | tuple) and all(type(t) is int for t in prompt):  # bool is not a token id
        token_ids = list(prompt)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} outside the vocabulary (size {vocab_size})")
    else:
        raise ValueError(f"prompt: must be a string or a list of token ids; got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("prompt: must not be empty")
    return token_ids


def check_param_token_ids(params: SamplingParams, *, vocab_size: int) -> None:
    """stop_token_ids, allowed_token_ids and logit_bias name only ids of the vocabulary."""
    for name, ids in (("stop_token_ids", params.stop_token_ids or ()), ("allowed_token_ids",
                      params.allowed_token_ids or ()), ("logit_bias", params.logit_bias or ())):
        outside = [i for i in ids if i >= vocab_size]
        if outside:
            raise ValueError(f"{name}: {outside[:5]} outside the vocabulary (size {vocab_size})")


def resolved_max_tokens(prompt_len: int, params: SamplingParams, *, max_model_len: int, block_size: int,
                        num_blocks: int) -> int:
    """The request's max_tokens (None: the room left in the context), checked against context and KV pool."""
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt: {prompt_len} tokens leave no room to generate within max_model_len="
                         f"{max_model_len}; shorten the prompt")
    room = max_model_len - prompt_len
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise ValueError(f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"max_model_len={max_model_len}; lower max_tokens to at most {room}")
    # The last sampled token is never computed, so a sequence holds at most prompt + max_tokens - 1.
    if cdiv(prompt_len + max_tokens - 1, block_size) > num_blocks:
        raise ValueError(f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) does not fit "
                         f"the KV cache ({num_blocks * block_size} tokens); lower max_tokens or raise "
                         "num_kv_blocks / kv_cache_memory_bytes")
    return max_tokens
