"""N-gram (prompt lookup) proposer: guess the next tokens by finding the sequence's last n tokens earlier
in its own prompt or output and proposing what followed them there.

Free to run (no model), and it pays on copy-heavy text: extraction, quoting, code edits, where the output
repeats spans of the prompt. For n from prompt_lookup_max down to prompt_lookup_min, the longest suffix
that occurs earlier wins; of its earlier occurrences the most recent one is used (it is the likeliest to
continue the same way). The proposal is q = one-hot for the rejection sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Earlier windows start at 0 .. num_tokens - n - 1 (the suffix itself starts at num_tokens - n).
    last_is_equal = tokens[:-1] == tokens[-1]  # windows ending at i + n - 1 must end with the last token
    if not last_is_equal.any():
        return []
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: num_tokens - 1], n)
        matches = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Proposes up to k tokens per sequence by prompt lookup (see module docstring)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, seqs: Sequence[object], max_tokens: Sequence[int]) -> list[tuple[list[int], None]]:
        """Per sequence: (proposed token ids, at most its max_tokens entry; None: q is one-hot)."""
        # seqs: Sequence or a draft's position view, each with token_ids (duck-typed here)
        return [
            (propose_ngram(seq.token_ids, min(self.k, limit), self.min_n, self.max_n), None)  # type: ignore[attr-defined]
            for seq, limit in zip(seqs, max_tokens, strict=True)
        ]

    def forget(self, seqs: Sequence[object]) -> None:
        """Nothing is kept per sequence."""

    def close(self) -> None:
        """Nothing to release."""
