"""The result rows a ShardRunner hands to the store (batchinfer.store.results.apply_results).

A success carries the choices and token counts; an error carries OpenAI's {code, message}, its message
naming the input line as ingest's errors do (ARCHITECTURE.md, contract 8).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from batchinfer.store.shards import PendingRequest
from batchinfer.wire.embeddings import encode
from batchinfer.wire.result_row import (
    ChatLogprobs,
    ChatTokenLogprob,
    Choice,
    CompletionLogprobs,
    ErrorRow,
    Logprobs,
    PromptLogprobs,
    SuccessRow,
    TokenLogprob,
)

if TYPE_CHECKING:
    from batchinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput


def error_row(request: PendingRequest, code: str, message: str) -> ErrorRow:
    """A request's error result; its message names the input line, as ingest's errors do (contract 8)."""
    return {"request_id": request.request_id,
            "error": {"code": code, "message": f"line {request.line_number}: {message}"}}


def result_row(request: PendingRequest, output: RequestOutput, echo: str = "") -> SuccessRow:
    """A finished request's result: its choices (echo prepended to each text) and token counts."""
    choices: list[Choice] = []
    for completion in output.outputs:
        choices.append({
            "index": completion.index,
            "text": echo + completion.text,
            "finish_reason": completion.finish_reason,
            "logprobs": logprobs_object(request, completion, text_start=len(echo)),
        })
    row: SuccessRow = {
        "request_id": request.request_id,
        "choices": choices,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": sum(len(c.token_ids) for c in output.outputs),
        "cached_tokens": output.num_cached_tokens,
    }
    if output.prompt_logprobs is not None:
        row["prompt_logprobs"] = prompt_logprobs_list(output.prompt_logprobs)
    return row


def prompt_logprobs_list(entries: list[dict[int, Logprob] | None]) -> PromptLogprobs:
    """vLLM's prompt_logprobs JSON: per prompt token null or {token id: {logprob, rank, decoded_token}}."""
    return [None if entry is None else
            {str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in entries]


def embedding_row(request: PendingRequest, vectors: list[list[float]], tokens: int,
                  encoding_format: str) -> SuccessRow:
    """An embeddings request's result: one embedding per input (floats or base64) and the tokens read."""
    return {"request_id": request.request_id, "embeddings": [encode(v, encoding_format) for v in vectors],
            "prompt_tokens": tokens, "completion_tokens": 0, "cached_tokens": 0}


def logprobs_object(request: PendingRequest, completion: CompletionOutput,
                    text_start: int = 0) -> Logprobs | None:
    """OpenAI's logprobs object (chat: a `content` list; completions: parallel lists with each token's
    `text_offset`, counted from `text_start`, where the generated text begins in the choice's text), or
    None."""
    if not completion.logprobs:
        return None
    num_top = request.params.logprobs or 0
    positions = []
    for token_id, per_position in zip(completion.token_ids, completion.logprobs, strict=False):
        chosen = per_position.get(token_id)
        ranked = sorted(per_position.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        positions.append((chosen, ranked[:num_top]))
    if request.endpoint == "chat":
        content: list[ChatTokenLogprob] = [
            {**token_entry(chosen), "top_logprobs": [token_entry(lp) for lp in top]}
            for chosen, top in positions]
        return ChatLogprobs(content=content)
    tokens = [token_entry(chosen)["token"] for chosen, _ in positions]
    offsets = list(itertools.accumulate((len(token) for token in tokens[:-1]), initial=text_start))
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[token_entry(chosen)["logprob"] for chosen, _ in positions],
        top_logprobs=[{lp.decoded_token or "": lp.logprob for lp in top} for _, top in positions],
        text_offset=offsets if tokens else [],
    )


def token_entry(logprob: Logprob | None) -> TokenLogprob:
    """One token of OpenAI's logprobs content: text, logprob and UTF-8 bytes."""
    token = (logprob.decoded_token or "") if logprob is not None else ""
    return {"token": token, "logprob": logprob.logprob if logprob is not None else None,
            "bytes": list(token.encode())}
