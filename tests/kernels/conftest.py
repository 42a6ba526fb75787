"""Kernel tests run on CPU through Triton's interpreter (small shapes) or on CUDA compiled (full size).

Triton decides interpreter vs compiler once per process, when it is imported (see
batchinfer/kernels/_device.py), so without a GPU TRITON_INTERPRET=1 is set here, before anything below
imports triton. In a whole-suite run some earlier test module may import `batchinfer.kernels` (and so
triton) first: set TRITON_INTERPRET=1 in the environment then (the cpu cases fail with that advice
otherwise).
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> torch.device:
    """cpu: the interpreter on small shapes (CPU-only machines); cuda: compiled kernels, full-size shapes."""
    pytest.importorskip("triton")
    from batchinfer.kernels._device import INTERPRETED

    if request.param == "cuda":
        if not HAS_CUDA:
            pytest.skip("needs a CUDA GPU")
        if INTERPRETED:
            pytest.skip("TRITON_INTERPRET=1: the compiled kernels are not in use")
    elif not INTERPRETED:
        if HAS_CUDA:
            pytest.skip("a GPU is present: the kernels are compiled, "
                        "the interpreter cases run on CPU-only hosts")
        pytest.fail("triton was imported before TRITON_INTERPRET=1 could be set (tests/kernels/conftest.py); "
                    "run the tests with TRITON_INTERPRET=1 in the environment")
    return torch.device(request.param)
