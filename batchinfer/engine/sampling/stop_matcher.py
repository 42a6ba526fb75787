"""Stop-string matching whose cost per generated character does not grow with the stop list.

An Aho-Corasick automaton over a request's stop strings (a trie with failure links), built once per
distinct stop list and shared by every sequence using it. A sequence keeps only its automaton state and
feeds each new piece of output text through `scan`: amortized O(1) work per character, however many
stop strings there are (a plain `text.find(stop)` per stop string costs O(len(stop list)) per token,
which is how one request with a 30,000-entry list slowed a whole batch down ~70x).

Invariants on the fields (state 0 is the root, the empty string):
- `_children[s]` maps a character to the state of the string one character longer;
- `_fail[s]` is the state of the longest proper suffix of s's string that is also a trie prefix;
- `_match_len[s]` is the length of the longest stop string that is a suffix of s's string (0: none),
  `_match_stop[s]` that stop string. So after feeding a character, a match ends there iff
  `_match_len[state]`, and the longest one is the earliest-starting match ending at that character.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence

from cachetools import LRUCache

# Automata kept for reuse, in bytes (STATE_BYTES a state, an estimate: its dict and list slots); a stop
# list is request data, and a long one makes a large automaton.
MATCHERS_CACHE_BYTES = 128 << 20
STATE_BYTES = 256


class StopMatcher:
    """The automaton of one stop list; `scan` advances a caller-held state over new text."""

    __slots__ = ("_children", "_fail", "_match_len", "_match_stop", "longest")

    @property
    def nbytes(self) -> int:
        """An estimate of the automaton's memory (what the cache counts)."""
        return STATE_BYTES * len(self._children)

    def __init__(self, stops: Sequence[str]) -> None:
        children: list[dict[str, int]] = [{}]
        match_len, match_stop = [0], [""]
        for stop in stops:
            state = 0
            for char in stop:
                nxt = children[state].get(char)
                if nxt is None:
                    nxt = children[state][char] = len(children)
                    children.append({})
                    match_len.append(0)
                    match_stop.append("")
                state = nxt
            if not match_len[state]:  # a repeated stop string keeps its first entry
                match_len[state], match_stop[state] = len(stop), stop
        fail = [0] * len(children)
        queue = deque(children[0].values())
        while queue:  # breadth first: a state's fail link is final before its children's are computed
            state = queue.popleft()
            for char, child in children[state].items():
                queue.append(child)
                link = fail[state]
                while link and char not in children[link]:
                    link = fail[link]
                fail[child] = children[link].get(char, 0) if state else 0
                if not match_len[child]:  # its own stop string, if any, is longer than any suffix's
                    match_len[child], match_stop[child] = match_len[fail[child]], match_stop[fail[child]]
        self._children, self._fail = children, fail
        self._match_len, self._match_stop = match_len, match_stop
        self.longest = max(map(len, stops), default=0)  # characters a streamed text holds back

    def scan(self, state: int, text: str) -> tuple[int, tuple[int, str] | None]:
        """Feed `text` from `state`: (new state, (start offset in text, stop) of the earliest-starting
        match that ends inside text, or None). The start offset is negative when the match began in
        text fed before."""
        children, fail, match_len = self._children, self._fail, self._match_len
        best: tuple[int, str] | None = None
        for offset, char in enumerate(text):
            while state and char not in children[state]:
                state = fail[state]
            state = children[state].get(char, 0)
            length = match_len[state]
            if length and (best is None or offset - length + 1 < best[0]):
                best = (offset - length + 1, self._match_stop[state])
        return state, best


_MATCHERS: LRUCache[tuple[str, ...], StopMatcher] = LRUCache(maxsize=MATCHERS_CACHE_BYTES,
                                                             getsizeof=lambda matcher: matcher.nbytes)
_MATCHERS_LOCK = threading.Lock()


def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The (shared) automaton of a stop list: n sibling sequences and repeated lists build it once (kept
    within MATCHERS_CACHE_BYTES, least recently used let go)."""
    with _MATCHERS_LOCK:
        matcher = _MATCHERS.get(stops)
    if matcher is None:
        matcher = StopMatcher(stops)
        with _MATCHERS_LOCK, contextlib.suppress(ValueError):  # ValueError: larger than the whole cache
            _MATCHERS[stops] = matcher
    return matcher
