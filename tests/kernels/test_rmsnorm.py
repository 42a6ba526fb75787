"""rms_norm (Triton) against rms_norm_ref, and the twin against Hugging Face's LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch

from batchinfer.kernels.reference import rms_norm_ref

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf_llama_rmsnorm(dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
    x = torch.randn(5, 7, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 7, 96, generator=gen).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, norm.weight, 1e-5), norm(x))
        out, new_residual = rms_norm_ref(x, norm.weight, 1e-5, residual=residual)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(out, norm(x + residual))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 96, 4096])
def test_kernel_matches_reference(device, with_residual, hidden) -> None:
    from batchinfer.kernels import rms_norm

    dtypes = [torch.float32] if device.type == "cpu" else [torch.float32, torch.float16, torch.bfloat16]
    rows = (3, 5) if device.type == "cpu" else (64, 129)
    gen = torch.Generator().manual_seed(hidden)
    for dtype in dtypes:
        x = torch.randn(*rows, hidden, generator=gen).to(dtype).to(device)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
        residual = torch.randn(*rows, hidden, generator=gen).to(dtype).to(device) if with_residual else None
        got = rms_norm(x, weight, 1e-6, residual=residual)
        want = rms_norm_ref(x, weight, 1e-6, residual=residual)
        if with_residual:
            assert torch.equal(got[1], want[1])  # the new residual is the plain sum, bit for bit
            got, want = got[0], want[0]
        assert got.shape == x.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_rejects_mismatched_weight(device) -> None:
    from batchinfer.kernels import rms_norm

    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \[64\]"):
        rms_norm(x, torch.ones(32, device=device))
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm(x, torch.ones(64, device=device), residual=torch.randn(2, 32, device=device))
