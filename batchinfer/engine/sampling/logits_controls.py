"""vLLM's logits controls: allowed_token_ids, bad_words and OpenAI's logit_bias, on the rows asking for them.

The sampler calls `apply_logits_controls` only when some row of the step has one (SamplingParams.
has_logits_controls), so a step without them costs nothing. Applied to the logits after the raw logprobs
are taken and before penalties and temperature (vLLM V1's order for these processors).

Bad words follow vLLM: each word is tokenized as given and with a leading space (`bad_words_token_ids`,
once per request); a one-token word is always banned, a longer one bans its last token when the output
so far ends with the word's other tokens.

Cost per step independent of the lists' lengths (README "Security"): each request's controls are
precomputed once (`RequestControls`, kept in a byte-bounded cache): allowed_token_ids, logit_bias and the
one-token bad words become one dense additive row (0, the bias, or -inf), added to all controlled rows in
one `index_add_`; the longer bad words become an Aho-Corasick automaton over token ids, whose state after
the output depends only on its last `depth` tokens (no state survives a step), and every ban of the step
is one indexed write.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Sequence_
from typing import TYPE_CHECKING

import torch
from cachetools import LRUCache

from batchinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchinfer.engine.core.tokenizer import TextTokenizer
    from batchinfer.engine.sampling.sampled_row import SampledRow

CONTROLS_CACHE_BYTES = 256 << 20  # precomputed rows of the requests in flight (a row is 4 x vocab bytes)


def bad_words_token_ids(tokenizer: TextTokenizer, words: list[str]) -> list[list[int]]:
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


class BadWordsAutomaton:
    """Aho-Corasick over the multi-token bad words' prefixes: which last tokens the output now bans."""

    def __init__(self, words: list[list[int]]) -> None:
        self.goto: list[dict[int, int]] = [{}]
        self.last: list[list[int]] = [[]]  # last tokens of the words whose prefix ends at this node
        for word in words:
            node = 0
            for token_id in word[:-1]:
                nxt = self.goto[node].get(token_id)
                if nxt is None:
                    nxt = self.goto[node][token_id] = len(self.goto)
                    self.goto.append({})
                    self.last.append([])
                node = nxt
            self.last[node].append(word[-1])
        self.depth = max((len(word) - 1 for word in words), default=0)  # the longest prefix
        self.fail = [0] * len(self.goto)
        self.output = [-1] * len(self.goto)  # nearest node on the fail chain (itself included) with words
        queue = deque(self.goto[0].values())
        while queue:
            node = queue.popleft()
            self.output[node] = node if self.last[node] else self.output[self.fail[node]]
            for token_id, child in self.goto[node].items():
                fallback = self.fail[node]
                while fallback and token_id not in self.goto[fallback]:
                    fallback = self.fail[fallback]
                target = self.goto[fallback].get(token_id, 0)
                self.fail[child] = target if target != child else 0
                queue.append(child)

    def banned_after(self, tail: list[int]) -> list[int]:
        """The last tokens banned after an output ending with `tail` (its last `depth` tokens suffice)."""
        goto, fail = self.goto, self.fail
        state = 0
        for token_id in tail:
            while state and token_id not in goto[state]:
                state = fail[state]
            state = goto[state].get(token_id, 0)
        banned: list[int] = []
        node = self.output[state]
        while node > 0:
            banned.extend(self.last[node])
            node = self.output[fail[node]]
        return banned


class RequestControls:
    """One request's controls, precomputed for a logits width: the additive row and the automaton."""

    def __init__(self, params: SamplingParams, bad_words: list[list[int]], vocab: int,
                 device: torch.device) -> None:
        self.params, self.bad_words = params, bad_words  # held: the cache key is their identity
        always = [word[0] for word in bad_words if len(word) == 1 and word[0] < vocab]
        longer = [word for word in bad_words if len(word) > 1 and word[-1] < vocab]
        self.automaton = BadWordsAutomaton(longer) if longer else None
        self.row: torch.Tensor | None = None  # added to the row's logits: 0, the bias, or -inf (banned)
        allowed, bias = params.allowed_token_ids, params.logit_bias
        if allowed is not None or bias or always:
            row = torch.zeros(vocab, dtype=torch.float32)
            if allowed is not None:
                row.fill_(float("-inf"))
                row[[t for t in allowed if t < vocab]] = 0.0
            if bias:
                ids = [t for t in bias if t < vocab]
                row[ids] += torch.tensor([bias[t] for t in ids], dtype=torch.float32)
            row[always] = float("-inf")
            self.row = row.to(device)
        automaton_bytes = 0 if self.automaton is None else 200 * len(self.automaton.goto)
        self.nbytes = 512 + (0 if self.row is None else 4 * vocab) + automaton_bytes


class ControlsCache:
    """RequestControls by request (its params and tokenized bad words), LRU, bounded in bytes."""

    def __init__(self, max_bytes: int = CONTROLS_CACHE_BYTES) -> None:
        self._entries: LRUCache[tuple[int, int, int], RequestControls] = LRUCache(
            maxsize=max_bytes, getsizeof=lambda controls: controls.nbytes)

    def get(self, seq: SampledRow, vocab: int, device: torch.device) -> RequestControls:
        """The controls of `seq`'s request for logits `vocab` wide, built on first use."""
        params, bad_words = seq.params, seq.bad_words_token_ids
        key = (id(params), id(bad_words), vocab)
        controls = self._entries.get(key)
        if controls is None or controls.params is not params or controls.bad_words is not bad_words:
            controls = RequestControls(params, bad_words, vocab, device)
            if controls.nbytes <= self._entries.maxsize:
                self._entries[key] = controls
        return controls


def apply_logits_controls(logits: torch.Tensor, seqs: Sequence_[SampledRow], rows: list[int],
                          cache: ControlsCache | None = None) -> None:
    """Apply each row's allowed_token_ids, bad_words and logit_bias to `logits`, in place: one batched add
    of the precomputed rows and one indexed write of the bad words' bans."""
    vocab, device = logits.shape[1], logits.device
    cache = cache if cache is not None else ControlsCache()
    added_rows: list[int] = []
    added: list[torch.Tensor] = []
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    for i in rows:
        seq = seqs[i]
        controls = cache.get(seq, vocab, device)
        if controls.row is not None:
            added_rows.append(i)
            added.append(controls.row)
        automaton = controls.automaton
        if automaton is not None:
            seen = min(automaton.depth, seq.num_output_tokens)
            token_ids = seq.token_ids
            banned = automaton.banned_after(token_ids[len(token_ids) - seen:] if seen else [])
            ban_rows.extend([i] * len(banned))
            ban_cols.extend(banned)
    if added_rows:
        index = torch.tensor(added_rows, device=device)
        logits.index_add_(0, index, torch.stack(added).to(logits.dtype))
    if ban_rows:
        logits[torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device)] = float("-inf")
