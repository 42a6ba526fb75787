"""The batched LoRA product: each adapter's delta added to its segment of a linear layer's output.

One step's T packed tokens belong to sequences of different adapters and of the base model. The model
runner groups them once per step into a LoRABatch (the step's adapter layout, ARCHITECTURE.md contract 3):
per adapter active in the step, the packed rows of its tokens, as a slice when they are contiguous. Each
adapted linear layer then adds, per adapter, x[rows] @ a.T @ b.T to out[rows] (punica's SGMV: a
segmented, gathered pair of matmuls), before a row-parallel layer's all-reduce. Base rows get nothing, and
a step without adapter rows carries no LoRABatch at all, so the base model's path is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.engine.lora.adapter import LoRAAdapter


@dataclass
class LoRASegment:
    """One adapter's rows of the step: a slice when contiguous, else an index tensor [n] int64."""

    adapter: LoRAAdapter
    rows: slice | torch.Tensor


@dataclass
class LoRABatch:
    """The step's adapter layout: per active adapter, its packed token rows (base rows are in none).

    Invariant: segments are disjoint, their rows lie in [0, T), and at most max_loras adapters appear.
    """

    segments: list[LoRASegment]

    def apply(self, module_key: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's linear output, [T, out]) plus each segment's adapter delta for module_key, in place."""
        for segment in self.segments:
            weights = segment.adapter.weights.get(module_key)
            if weights is None:  # this adapter leaves the module alone
                continue
            rows = segment.rows
            delta = (x[rows] @ weights.a.T) @ weights.b.T
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out


def build_lora_batch(
    adapters: list[LoRAAdapter | None], q_lens: list[int], device: torch.device
) -> LoRABatch | None:
    """The LoRABatch of a step whose entry i (q_lens[i] packed tokens) runs under adapters[i] (None: base).

    None when no entry has an adapter: the step then does no LoRA work at all.
    """
    if not any(adapters):
        return None
    spans: dict[int, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
    start = 0
    for adapter, q_len in zip(adapters, q_lens, strict=True):
        if adapter is not None:
            entry = spans.setdefault(id(adapter), (adapter, []))
            ranges = entry[1]
            if ranges and ranges[-1][1] == start:  # adjacent entries of one adapter: one range
                ranges[-1] = (ranges[-1][0], start + q_len)
            else:
                ranges.append((start, start + q_len))
        start += q_len
    segments = []
    for adapter, ranges in spans.values():
        if len(ranges) == 1:
            rows: slice | torch.Tensor = slice(*ranges[0])
        else:
            rows = torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)
        segments.append(LoRASegment(adapter, rows))
    return LoRABatch(segments)
