"""Gated activation of the Llama MLP: silu(gate) * up on one fused [.., 2 * I] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.engine.layers.cpu_attention import fused_ops_for


class SiluAndMul(nn.Module):
    """Split the last dim in halves (gate, up) and return silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * I] -> [T, I]."""
        ops = fused_ops_for(x)
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            return ops.silu_and_mul(x)  # one pass, rounding like F.silu(gate) * up
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
