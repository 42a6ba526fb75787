"""vLLM's spec-decode Prometheus counters under `batchinfer:`, with the engine's two labels, bound once.

  spec_decode_num_drafts                  proposals verified (one per speculating sequence per step)
  spec_decode_num_draft_tokens            tokens proposed
  spec_decode_num_accepted_tokens         of those, accepted
  spec_decode_num_accepted_tokens_per_pos accepted at draft position i (label `position`)

Exported wherever the engine's metrics are (the process registry: the worker's and the API's /metrics).
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from batchinfer.engine.metrics import LABELS, PREFIX
from batchinfer.engine.spec_decode.speculator import SpecDecodeCounts

_FAMILIES: dict[int, tuple[Counter, Counter, Counter, Counter]] = {}
_lock = threading.Lock()


def _families(registry: CollectorRegistry) -> tuple[Counter, Counter, Counter, Counter]:
    """The four families of `registry`, created once (prometheus_client forbids duplicates)."""
    with _lock:
        if id(registry) not in _FAMILIES:
            def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
                return Counter(f"{PREFIX}{name}", doc, [*LABELS, *extra], registry=registry)

            _FAMILIES[id(registry)] = (
                counter("spec_decode_num_drafts", "Speculative proposals verified."),
                counter("spec_decode_num_draft_tokens", "Speculative tokens proposed."),
                counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted."),
                counter("spec_decode_num_accepted_tokens_per_pos",
                        "Speculative tokens accepted, by position in the proposal.", ("position",)),
            )
        return _FAMILIES[id(registry)]


class SpecDecodeMetrics:
    """One engine's spec-decode counters; fold() adds what its SpecDecodeCounts gained since the last."""

    def __init__(self, labels: dict[str, str], num_speculative_tokens: int,
                 registry: CollectorRegistry = REGISTRY) -> None:
        drafts, draft_tokens, accepted, per_position = _families(registry)
        values = (labels["model_name"], labels["engine"])
        self._drafts = drafts.labels(*values)
        self._draft_tokens = draft_tokens.labels(*values)
        self._accepted = accepted.labels(*values)
        self._per_position = [per_position.labels(*values, str(i)) for i in range(num_speculative_tokens)]
        self._reported: SpecDecodeCounts | None = None

    def fold(self, counts: SpecDecodeCounts) -> None:
        """Add the counts since the last fold (a no-op when nothing was verified since)."""
        if self._reported is not None and counts.num_drafts == self._reported.num_drafts:
            return
        delta = counts.since(self._reported)
        self._reported = counts.copy()
        self._drafts.inc(delta.num_drafts)
        self._draft_tokens.inc(delta.num_draft_tokens)
        self._accepted.inc(delta.num_accepted_tokens)
        for position, count in enumerate(delta.accepted_per_position):
            if count:
                self._per_position[position].inc(count)
