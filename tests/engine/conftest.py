"""Engine test fixtures: LLMs that are checked for leaked KV blocks after each test.

Torch runs on one thread in tests (OMP_NUM_THREADS=1 in tests/conftest.py): on a shared 2-core machine more
threads only contend.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from batchinfer.engine import LLM


@pytest.fixture
def make_llm() -> Iterator[Any]:
    """Build LLMs on CPU/fp32; afterwards assert every request finished and no KV block leaked."""
    made: list[LLM] = []

    def make(path: Path, **kwargs: Any) -> LLM:
        llm = LLM(str(path), device="cpu", dtype="float32", **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert not llm.engine.has_unfinished()
        llm.engine.block_manager.check_invariants([])  # every ref count back to zero
        assert llm.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """One torch thread for a module: on a shared 2-core machine more threads only contend (3-5x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
