"""Issue 28 item 4: the stop-list automata kept for reuse are bounded in bytes (a stop list is request
data: a 1 MB line of stop strings is an automaton of ~250 MB of Python objects)."""

from __future__ import annotations

from batchinfer.engine.sampling import stop_matcher as module
from batchinfer.engine.sampling.stop_matcher import stop_matcher


def test_long_stop_lists_are_kept_within_the_byte_bound_and_short_ones_shared() -> None:
    stops = ("END", "\n\n")
    assert stop_matcher(stops) is stop_matcher(stops)  # n siblings and repeated lists share one
    # 16 stop strings of 17,000 characters, no two sharing a prefix: ~272,000 states, ~70 MB counted
    big = [tuple(f"{seed}{i:02d}" + "x" * 17_000 for i in range(16)) for seed in range(3)]
    sizes = [stop_matcher(stop_list).nbytes for stop_list in big]
    assert all(size > module.MATCHERS_CACHE_BYTES // 2 for size in sizes)  # two would not fit together
    assert module._MATCHERS.currsize <= module.MATCHERS_CACHE_BYTES
    assert stop_matcher(big[2]) is stop_matcher(big[2])  # the newest is kept
    assert big[0] not in module._MATCHERS  # the older ones were let go
