"""RMSNorm, rounded exactly like Hugging Face's LlamaRMSNorm, with a fused residual-add variant (one C++ pass
on CPU: csrc/fused_ops.cpp's rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

from batchinfer.engine.layers.cpu_attention import fused_ops_for


class RMSNorm(nn.Module):
    """y = weight * x / rms(x); forward(x, residual) first adds the residual and returns (y, x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order and float32 upcast as transformers, so fp32 logits agree to the last bits.
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize x, or (x + residual) returning the sum too as the next residual."""
        ops = fused_ops_for(x)
        if (ops is not None and x.dim() == 2 and x.is_contiguous() and self.weight.dtype == x.dtype
                and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))):
            out = ops.rms_norm(x, residual, self.weight, self.eps)  # one pass, transformers' rounding
            return out[0] if residual is None else (out[0], out[1])
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
