"""Fused RMSNorm, optionally with the residual add before it (one program per row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._device import check_device


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, as the unfused `x + residual` would be.
        x = x + tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    # Hugging Face rounds the normalized row to the activation dtype before scaling by the weight.
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with residual returns (rms_norm(x + residual), x + residual)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape [{hidden}] (the last dim of x), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)}), got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    check_device(x, weight, *([] if residual is None else [residual]))
    weight = weight.contiguous()
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res2 = None
    if residual is not None:
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
    out = torch.empty_like(x2)
    residual_out = torch.empty_like(x2) if res2 is not None else out
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out,
            residual_out,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            out.stride(0),
            residual_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=res2 is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, residual_out.view(x.shape))
