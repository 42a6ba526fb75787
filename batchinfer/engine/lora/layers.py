"""The batched LoRA product: each adapter's delta added to its segment of a linear layer's output.

One step's T packed tokens belong to sequences of different adapters and of the base model. The model
runner groups them once per step into a LoRABatch (the step's adapter layout, ARCHITECTURE.md contract 3):
per adapter active in the step, the packed rows of its tokens, as a slice when they are contiguous. Each
adapted linear layer then adds, per adapter, x[rows] @ a.T @ b.T to out[rows] (punica's SGMV: a
segmented, gathered pair of matmuls), before a row-parallel layer's all-reduce. Base rows get nothing, and
a step without adapter rows carries no LoRABatch at all, so the base model's path is untouched.

On CUDA with Triton the same product runs as kernels.lora_bgmv (punica's BGMV): a slot per token and, per
module, the step's adapters stacked (zero-padded to their largest rank), kept by a StackCache while the
step's set of adapters does not change (a decode stretch rebuilds nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.engine.lora.adapter import LoRAAdapter

__all__ = ["KernelLayout", "LoRABatch", "LoRASegment", "StackCache", "build_lora_batch"]


@dataclass
class LoRASegment:
    """One adapter's rows of the step: a slice when contiguous, else an index tensor [n] int64."""

    adapter: LoRAAdapter
    rows: slice | torch.Tensor


class StackCache:
    """Per-module stacks of one ordered set of adapters (the kernel path), rebuilt when the set changes."""

    def __init__(self) -> None:
        self.adapters: list[LoRAAdapter] = []  # held, so the identity check below stays sound
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def get(self, adapters: list[LoRAAdapter], module_key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(a_stack [S, R, in], b_stack [S, out, R]) of module_key, None when no adapter adapts it."""
        if len(adapters) != len(self.adapters) or any(a is not b for a, b in zip(adapters, self.adapters,
                                                                                  strict=True)):
            self.adapters, self.stacks = list(adapters), {}
        if module_key not in self.stacks:
            self.stacks[module_key] = _stack(adapters, module_key)
        return self.stacks[module_key]


def _stack(adapters: list[LoRAAdapter], module_key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    weights = [adapter.weights.get(module_key) for adapter in adapters]
    present = [w for w in weights if w is not None]
    if not present:
        return None
    rank = max(w.a.shape[0] for w in present)
    ref = present[0]
    a_stack = ref.a.new_zeros(len(adapters), rank, ref.a.shape[1])
    b_stack = ref.b.new_zeros(len(adapters), ref.b.shape[0], rank)
    for slot, w in enumerate(weights):
        if w is not None:
            a_stack[slot, : w.a.shape[0]] = w.a
            b_stack[slot, :, : w.b.shape[1]] = w.b
    return a_stack, b_stack


@dataclass
class KernelLayout:
    """The kernel path's layout: the step's adapters in slot order and each token's slot (-1: base)."""

    adapters: list[LoRAAdapter]
    slot_index: torch.Tensor  # [T] int32
    stacks: StackCache


@dataclass
class LoRABatch:
    """The step's adapter layout: per active adapter, its packed token rows (base rows are in none).

    Invariant: segments are disjoint, their rows lie in [0, T), and at most max_loras adapters appear.
    """

    segments: list[LoRASegment]
    kernel: KernelLayout | None = None  # set on CUDA with Triton: the product runs as kernels.lora_bgmv

    def apply(self, module_key: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's linear output, [T, out]) plus each segment's adapter delta for module_key, in place."""
        if self.kernel is not None:
            stacks = self.kernel.stacks.get(self.kernel.adapters, module_key)
            if stacks is None:
                return out
            from batchinfer.kernels import lora_bgmv

            return lora_bgmv(x, out, stacks[0], stacks[1], self.kernel.slot_index)
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
    adapters: list[LoRAAdapter | None], q_lens: list[int], device: torch.device,
    stacks: StackCache | None = None,
) -> LoRABatch | None:
    """The LoRABatch of a step whose entry i (q_lens[i] packed tokens) runs under adapters[i] (None: base).

    None when no entry has an adapter: the step then does no LoRA work at all. With `stacks` (the kernel
    path) the batch also carries each token's slot.
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
    if stacks is None:
        return LoRABatch(segments)
    slots = {id(adapter): slot for slot, (adapter, _) in enumerate(spans.values())}
    entry_slots = torch.tensor([-1 if a is None else slots[id(a)] for a in adapters], dtype=torch.int32)
    slot_index = torch.repeat_interleave(entry_slots, torch.tensor(q_lens)).to(device)
    return LoRABatch(segments, KernelLayout([adapter for adapter, _ in spans.values()], slot_index, stacks))
