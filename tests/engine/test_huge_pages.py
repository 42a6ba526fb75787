"""worker/huge_pages.py: packed weights and the KV cache on transparent huge pages, the same values either
way, and ordinary tensors where the system grants no huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers.weight_packing import PanelLinear
from batchinfer.engine.worker import huge_pages
from batchinfer.engine.worker.model_runner import ModelRunner


def mapping_kib(address: int, field: str) -> int:
    """A /proc/self/smaps field (KiB, e.g. "Rss") of the mapping that holds address (0 if none)."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            current = start <= address < end
        elif current and line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds address (0 if none)."""
    return mapping_kib(address, "AnonHugePages")


@pytest.fixture
def no_huge_pages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    huge_pages.huge_pages_available.cache_clear()
    yield
    huge_pages.huge_pages_available.cache_clear()


needs_huge_pages = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                                      reason="transparent_hugepage is 'never' (or absent) here")


def test_slots_have_the_layouts_asked_each_on_a_page() -> None:
    layouts = [(torch.Size([10, 3]), torch.float32), (torch.Size([7]), torch.int64),
               (torch.Size([5, 4]), torch.bfloat16), (torch.Size([0, 2]), torch.float32)]
    slots = huge_pages.huge_page_slots(layouts)
    if slots is None:
        pytest.skip("no huge pages here")
    for (shape, dtype), slot in zip(layouts, slots, strict=True):
        assert slot.shape == shape and slot.dtype == dtype and slot.is_contiguous() and not slot.any()
        assert slot.data_ptr() % huge_pages.ALIGNMENT == 0
    slots[0].fill_(1)  # apart: writing one leaves the next as it was
    assert not slots[1].any()


def test_zeros_are_zeros_of_the_shape_and_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        zeros = huge_pages.huge_page_zeros((3, 0, 2) if dtype == torch.uint8 else (4, 5, 6), dtype)
        assert zeros.dtype == dtype and zeros.is_contiguous()
        assert not zeros.any()


@needs_huge_pages
def test_a_cpu_runner_streams_its_panels_and_kv_cache_from_huge_pages(tiny_llama: Path) -> None:
    probe = huge_pages.huge_page_buffer(4 << 20)
    assert probe is not None
    if anon_huge_kib(probe.fill_(1).data_ptr()) == 0:  # advised and written: granted here?
        pytest.skip("the kernel gave 4 KiB pages to an advised mapping (defrag setting, fragmented memory)")
    del probe
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32",
                                      kv_cache_memory_bytes=16 * 2**20))
    assert runner.kv_cache is not None
    # backed whole at allocation (before anything reads it), as torch.zeros did: a cache the machine cannot
    # hold fails the start
    cache_kib = runner.kv_cache.numel() * runner.kv_cache.element_size() // 1024
    assert mapping_kib(runner.kv_cache.data_ptr(), "Rss") >= cache_kib
    assert not runner.kv_cache.any()
    assert anon_huge_kib(runner.kv_cache.data_ptr()) > 0
    panels = [m.packed for m in runner.model.modules() if isinstance(getattr(m, "packed", None), PanelLinear)]
    if not panels:
        pytest.skip("float32 runs another GEMM than the panel GEMM here")
    assert all(anon_huge_kib(p.panels.data_ptr()) > 0 for p in panels)


def test_without_huge_pages_everything_stays_ordinary(no_huge_pages: None, tiny_llama: Path) -> None:
    assert not huge_pages.huge_pages_available()
    assert huge_pages.huge_page_buffer(1 << 20) is None
    assert huge_pages.huge_page_slots([(torch.Size([3]), torch.float32)]) is None
    zeros = huge_pages.huge_page_zeros((2, 3), torch.float32)
    assert zeros.shape == (2, 3) and not zeros.any()
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32",
                                      kv_cache_memory_bytes=2**20))
    assert huge_pages.place_packed_weights(runner.model) == 0


def test_outputs_do_not_depend_on_where_the_weights_live(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    class Seq:
        def __init__(self, token_ids: list[int], block_table: list[int]) -> None:
            self.token_ids, self.block_table, self.num_computed_tokens = token_ids, block_table, 0

    config = EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", block_size=4, num_kv_blocks=8)
    placed = ModelRunner(config)  # huge pages where this system grants them
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    huge_pages.huge_pages_available.cache_clear()
    try:
        ordinary = ModelRunner(config)
    finally:
        huge_pages.huge_pages_available.cache_clear()
    tokens = [1, 5, 9, 2, 7, 3]
    logits = [r.execute_model([(Seq(tokens, [0, 1]), len(tokens))]) for r in (ordinary, placed)]
    assert torch.equal(logits[0], logits[1])
