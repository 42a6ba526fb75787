"""A CPU runner's packed weights and KV cache on transparent huge pages (2 MiB), where the kernel grants them.

Why: a decode step streams every packed weight once (SmolLM2 in float32: 538 MB a step) and every cached
K/V row of its sequences. In 4 KiB pages each stream takes a TLB miss every 4 KiB, and the hardware
prefetchers stop at every page boundary. On the AMX Xeon (bench/panel_gemm.py --huge-pages: the 121 GEMMs
of a SmolLM2 step through the panel GEMM, weights from memory) the same panels on huge pages ran 1.10-1.14x
faster at 1-8 rows, 1.07-1.08x at 16-32 and 1.02x at 96.

Linux backs anonymous memory with huge pages when transparent_hugepage is "always", or "madvise" and the
range asked for them (madvise MADV_HUGEPAGE); "never" (or no such setting) leaves ordinary pages, and the
tensors here are then ordinary tensors. Memory is the same either way (but for each buffer's last huge
page, backed whole), and every page is written at once, as torch.zeros writes a KV cache: a cache too
large for the machine fails the worker's start, not a job halfway.

Only dense packs move: the panel GEMM's panels (PanelLinear), the bf16x3 halves (AmxLinear) of
float32_matmul_precision "high" (under "auto" the halves an embeddings call adds later stay where they are)
and the codes of exact 4-bit blocks (ExactBlockLinear).
oneDNN's and fbgemm's packed weights are opaque tensors whose memory is theirs. The copies cost a load
~0.4 s on SmolLM2 in float32 (538 MB); where the kernel must compact memory to find huge pages (defrag
"madvise" on a fragmented host) a large KV cache's first writes take longer too.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from batchinfer.engine.layers.amx_linear import AmxLinear
from batchinfer.engine.layers.exact_blocks import ExactBlockLinear
from batchinfer.engine.layers.weight_packing import PanelLinear

HUGE_PAGE_BYTES = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGNMENT = 4096  # each tensor starts a page: a stream's first prefetch stays inside its own tensor


@cache
def huge_pages_available() -> bool:
    """True where anonymous memory that asks for huge pages gets them (transparent_hugepage not "never")."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in setting or "[madvise]" in setting)


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A zero-filled uint8 CPU tensor of nbytes starting on a huge page boundary, or None (none granted here).

    An anonymous mapping (zeros until written) advised MADV_HUGEPAGE; numpy's view holds the mapping, and
    the tensor holds that view, so it is unmapped when the last tensor over it goes.
    """
    if nbytes <= 0 or not huge_pages_available():
        return None
    # whole huge pages from a boundary on: the mapping's start is only page-aligned
    span = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    try:  # private: a shared anonymous mapping is shmem, whose huge pages follow another setting
        mapping = mmap.mmap(-1, span + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a sandbox refusing madvise, a kernel without THP behind the setting: ordinary memory
        return None
    whole = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[skip : skip + nbytes]


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on huge pages where granted, else torch.zeros itself (CPU)."""
    slots = huge_page_slots([(torch.Size(shape), dtype)])
    if slots is None:
        return torch.zeros(*shape, dtype=dtype)
    return slots[0].zero_()  # zero_: every page backed now (the module docstring)


def huge_page_slots(layouts: Sequence[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor] | None:
    """Zero-filled contiguous tensors of these shapes and dtypes in one huge-page buffer, each starting a
    page, or None (no huge pages here)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in layouts]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // ALIGNMENT) * ALIGNMENT)
    buffer = huge_page_buffer(offsets[-1])
    if buffer is None:
        return None
    return [buffer[offset : offset + size].view(dtype).view(shape)
            for (shape, dtype), offset, size in zip(layouts, offsets[:-1], sizes, strict=True)]


def place_packed_weights(model: nn.Module) -> int:
    """Move the model's packed weights (panels, bf16x3 halves, block codes) onto huge pages; how many moved.

    Before the native decoder stack is built (worker/native_step.py reads the packs it is handed).
    """
    kernels = (getattr(module, attribute, None) for module in model.modules()
               for attribute in ("packed", "packed_high"))
    return place_packs([k for k in kernels if isinstance(k, PanelLinear | AmxLinear | ExactBlockLinear)])


PACK_ATTRIBUTES = {PanelLinear: "panels", AmxLinear: "halves", ExactBlockLinear: "codes"}  # what streams


def place_packs(kernels: Sequence[PanelLinear | AmxLinear | ExactBlockLinear]) -> int:
    """Move these kernels' packs into one huge-page buffer; returns how many moved (0: none granted here).

    One pack at a time: each old pack is freed (and trimmed) as its kernel takes the copy, so the peak is
    the packs once plus the largest. A kernel listed twice (two modules sharing it) moves once.
    """
    unique = list({id(k): k for k in kernels}.values())
    # attribute names, not the packs: a list of the old packs would keep each alive past its copy
    names = [PACK_ATTRIBUTES[type(k)] for k in unique]
    layouts = [(getattr(k, n).shape, getattr(k, n).dtype) for k, n in zip(unique, names, strict=True)]
    slots = huge_page_slots(layouts) if layouts else None
    if slots is None:
        return 0
    for kernel, name, slot in zip(unique, names, slots, strict=True):
        setattr(kernel, name, slot.copy_(getattr(kernel, name)))
        release_freed_heap()  # the old pack's memory, at once: the peak stays the packs plus one
    return len(slots)


def release_freed_heap() -> None:
    """Hand memory malloc holds free back to the system (glibc's malloc_trim; elsewhere nothing).

    Packing frees each dense weight, which raises glibc's mmap threshold, so later packs come from the heap,
    and a freed heap block stays resident until trimmed: without this, the old packs would stay counted.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
