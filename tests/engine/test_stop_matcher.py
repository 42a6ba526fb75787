"""The stop-string automaton: the same earliest match as a brute-force search, fed in any pieces, and a
per-character cost that does not grow with the stop list (issue 15: a 30,000-entry list)."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.sampling.stop_matcher import StopMatcher


def _brute_force(stops: list[str], text: str, fed: int) -> tuple[int, str] | None:
    """Earliest-starting stop that ends inside text[fed:] (ties: the shorter), as (start, stop)."""
    best = None
    for end in range(fed, len(text)):
        for stop in sorted(stops, key=len, reverse=True):
            start = end - len(stop) + 1
            if start >= 0 and text.startswith(stop, start) and (best is None or start < best[0]):
                best = (start, stop)
    return best


ALPHABET = st.sampled_from("abc")


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=6),
       pieces=st.lists(st.text(ALPHABET, max_size=5), min_size=1, max_size=6))
def test_matches_brute_force_across_pieces(stops: list[str], pieces: list[str]) -> None:
    matcher = StopMatcher(stops)
    state, text = 0, ""
    for piece in pieces:
        fed = len(text)
        text += piece
        state, found = matcher.scan(state, piece)
        expected = _brute_force(stops, text, fed)
        got = None if found is None else (fed + found[0], found[1])
        assert (got is None) == (expected is None), (stops, pieces, got, expected)
        if got is not None:
            assert got[0] == expected[0] and text.startswith(got[1], got[0])
            assert len(got[1]) == len(expected[1])
            return  # a sequence stops at its first match


def test_cost_per_character_does_not_grow_with_the_list() -> None:
    text = "the quick brown fox jumps over the lazy dog " * 200  # 8,800 characters, no stop inside
    few = StopMatcher(["STOP", "END"])
    many = StopMatcher([f"stop-{i}-{i * 7919 % 10007}" for i in range(30_000)])

    def seconds(matcher: StopMatcher) -> float:
        start = time.perf_counter()
        state = 0
        for i in range(0, len(text), 4):  # about one token at a time
            state, found = matcher.scan(state, text[i:i + 4])
            assert found is None
        return time.perf_counter() - start

    seconds(few), seconds(many)  # warm up
    assert seconds(many) < 3 * seconds(few) + 0.01
