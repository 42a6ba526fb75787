"""The tokens one CPU forward takes: max_num_batched_tokens, cut so the MLP's output fits malloc's reuse.

glibc's malloc serves a block over 32 MiB (its highest mmap threshold) with a fresh mmap and unmaps it again
on free, so a forward whose activations are bigger faults every page of them in anew, every layer. The cut
is for the MLP's gate_up output (tokens x 2 x intermediate_size, a rank's share under tensor parallelism),
the widest activation that grows with the tokens of every layer; it does not bound the logits (a step's
decodes or a prompt-logprobs chunk x the vocabulary, once a step), and an embeddings input longer than the
budget is still one forward. SmolLM2-135M in float32 at 4096 tokens a forward (that output 48 MiB), against
2048:
- the held-out embeddings job (240 texts): 44.6 s (7.4 s system, 3.9 M page faults) -> 41.9 s (0.5 s);
- prefill of 96 prompts of ~265 tokens: 38.0 / 35.4 s (5.9 / 5.3 s system) -> 34.1 / 33.7 s (1.1 / 0.5 s).
ModelRunner.step_tokens holds it; the engine's scheduler (its token budget per step), the packed embeddings
forward (embed_forward.py) and a draft model's catch-up forwards (spec_decode/draft.py) take this budget on a
CPU; CUDA's caching allocator keeps its blocks, so a GPU takes max_num_batched_tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MALLOC_REUSE_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
# a floor, so a very wide MLP still gives its GEMMs a prefill's rows (only 1024-4096 were measured: 1024
# ran 43.0 s against 2048's 41.9 s on the embeddings job above)
MIN_CHUNK_TOKENS = 256


def chunk_budget(budget: int, *, widest_row_bytes: int) -> int:
    """Tokens per CPU forward: budget, cut so the widest activation (tokens x widest_row_bytes) fits in
    MALLOC_REUSE_BYTES, never below MIN_CHUNK_TOKENS (nor above budget)."""
    return max(min(budget, MALLOC_REUSE_BYTES // widest_row_bytes), min(budget, MIN_CHUNK_TOKENS))


def step_token_budget(budget: int, *, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                      tensor_parallel_size: int = 1) -> int:
    """max_num_batched_tokens as a forward on `device` takes it (module docstring): on a CPU each rank's share
    of the MLP's gate_up output stays within MALLOC_REUSE_BYTES."""
    if device.type != "cpu":
        return budget
    share = -(-int(hf_config.intermediate_size) // tensor_parallel_size)  # a rank's columns of gate and up
    return chunk_budget(budget, widest_row_bytes=2 * share * dtype.itemsize)
