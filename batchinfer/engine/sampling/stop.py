"""check_stop: after a token is appended, decide whether its sequence is done (vLLM's stop rules).

In order: EOS (unless ignore_eos), then the request's stop token ids, then its stop strings (found by
the detokenizer, which also grows the output text), then length (max_tokens, or the context full at
max_model_len). EOS, stop ids and stop strings apply only to the tokens past the first min_tokens: the
sampler masks EOS and stop ids before that, and stop strings are not looked for.
"""

from __future__ import annotations

from collections.abc import Container

from batchinfer.engine.core.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, token_id: int, eos_token_ids: Container[int], max_model_len: int) -> bool:
    """Detokenize seq's last token (token_id) and apply the stop rules; True if seq just finished.

    A finished seq gets its FINISHED_* status and, for a stop token id or stop string, its stop_reason.
    """
    params = seq.params
    token_ids = seq.token_ids
    num_tokens = len(token_ids)
    num_output = num_tokens - seq.num_prompt_tokens
    may_stop = num_output > params.min_tokens
    status = None  # the finished status, once decided
    if may_stop and not params.ignore_eos and token_id in eos_token_ids:
        status = SequenceStatus.FINISHED_STOPPED
    elif may_stop and params.stop_token_ids and token_id in params.stop_token_ids:
        status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token_id
    detokenizer = seq.detokenizer
    assert detokenizer is not None  # set by the engine when the request is added
    stop_string = detokenizer.update(token_ids, stop_terminated=status is not None, check_stop=may_stop)
    if status is None and stop_string is not None:
        status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_string
    if status is None and (num_output >= seq.max_tokens or num_tokens >= max_model_len):
        status = SequenceStatus.FINISHED_LENGTH_CAPPED
    if status is None:
        return False
    seq.status = status
    return True
