"""vLLM's logits controls: allowed_token_ids, bad_words and OpenAI's logit_bias, on the rows asking for them.

The sampler calls `apply_logits_controls` only when some row of the step has one (SamplingParams.
has_logits_controls), so a step without them costs nothing. Applied to the logits after the raw logprobs
are taken and before penalties and temperature (vLLM V1's order for these processors).

Bad words follow vLLM: each word is tokenized as given and with a leading space (`bad_words_token_ids`,
once per request); a one-token word is always banned, a longer one bans its last token when the output
so far ends with the word's other tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from batchinfer.engine.sequence import Sequence


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token id sequences of `words`, each as given (left-stripped) and after a space (vLLM's rule)."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        # vLLM keeps the spaced form only when it is a different token sequence of the same length
        if spaced and (not plain or spaced[0] != plain[0] and len(spaced) == len(plain)):
            out.append(spaced)
    return out


def apply_logits_controls(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Apply each row's allowed_token_ids, bad_words and logit_bias to `logits`, in place."""
    vocab = logits.shape[1]
    for i in rows:
        seq = seqs[i]
        params = seq.params
        if params.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            keep[[t for t in params.allowed_token_ids if t < vocab]] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        for word_ids in seq.bad_words_token_ids:
            prefix = word_ids[:-1]
            if word_ids[-1] < vocab and (not prefix or seq.output_token_ids[-len(prefix):] == prefix):
                logits[i, word_ids[-1]] = float("-inf")
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab]
            if ids:
                bias = torch.tensor([params.logit_bias[t] for t in ids], dtype=logits.dtype,
                                    device=logits.device)
                logits[i, ids] += bias
