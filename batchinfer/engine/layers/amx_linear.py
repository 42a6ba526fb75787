"""float32 linears on AMX's bf16 tiles, each float32 taken as the sum of two bfloat16s (bf16x3).

Why: on a CPU with AMX a float32 GEMM runs on AVX-512 FMAs at ~0.35-0.4 TFLOP/s (2 cores), while AMX's
bf16 tiles run ~8x that. csrc/amx_gemm.cpp splits x and W into high halves and residues and sums three
bf16 products in float32 (x W = xh Wh + xh Wl + xl Wh). On an AMX Xeon (bench/panel_gemm.py, a SmolLM2
step's 121 GEMMs, weights from memory) that is 1.2-1.9x the panel GEMM (float32's default there) from 16
to 512 rows, 0.86-0.96x at 1-8 rows (where both stream the weights), at a largest error of ~5e-6 of the
output's scale against ~1e-6 for the float32 GEMMs (the same bench prints both). This is what
torch.set_float32_matmul_precision("high") names "the sum of two bfloat16 numbers"; the engine's knob is
EngineConfig.float32_matmul_precision (engine/config.py: "auto" runs embeddings so, "high" everything).

AmxLinear packs a weight once (pack_amx_weight: 4 bytes per parameter, as float32). with_high_precision
gives a packed model's float32 linears that kernel: under "high" instead of their IEEE one, under "auto"
beside it (LinearBase.packed_high, unpacked from the panel GEMM's lossless panels or the kept dense weight,
on the first embeddings: a worker that has embedded holds both, 8 bytes per float32 parameter), which the
steps whose AttentionContext sets float32_matmul_high run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.native.cpu_features import cpu_has_amx_bf16

if TYPE_CHECKING:
    from batchinfer.engine.layers.weight_packing import LinearFn

logger = logging.getLogger(__name__)


class AmxLinear:
    """x -> x @ weight.T + bias in bf16x3 on AMX tiles (csrc/amx_gemm.cpp) over the weight packed once.

    float32 in and out. A class so that worker/native_step.py can hand the halves to the C++ decoder stack.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, extension: Any) -> None:
        self.halves = extension.pack_amx_weight(weight.detach().float().contiguous())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self._extension = extension

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the kernel sees K only to its 32-wide tile
            raise ValueError(f"AmxLinear: x has {x.shape[-1]} features, the weight {self.in_features}")
        if x.dim() != 2:  # the engine's activations are [T, features]; keep any other caller working
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return self._extension.amx_linear(x, self.halves, self.bias, self.out_features)


def amx_extension() -> Any:
    """The native extension where its AMX GEMM is built and the kernel granted AMX's tile state, else None."""
    if not cpu_has_amx_bf16():
        return None
    ext = cpu_attention.load()
    return ext if ext is not None and hasattr(ext, "amx_gemm_built") and ext.amx_gemm_built() else None


def amx_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn | None:
    """x -> x @ weight.T + bias in bf16x3 (AmxLinear) for a float32 weight, or None where it cannot run."""
    ext = amx_extension()
    if ext is None or weight.dtype != torch.float32:
        return None
    return AmxLinear(weight, bias, ext)


@runtime_checkable
class UnpacksExactly(Protocol):
    """A packed kernel that gives its weight back exactly (PanelLinear, ExactBlockLinear), or None."""

    bias: torch.Tensor | None

    def weight(self) -> torch.Tensor | None:
        """The [N, K] weight, exactly as packed; None where the kernel no longer holds it."""
        ...


def dense_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A float32 linear's exact weight and bias: kept dense, or unpacked from its kernel; else None."""
    from batchinfer.engine.layers.linear import LinearBase

    packed = getattr(module, "packed", None)
    if isinstance(packed, UnpacksExactly):  # exact blocks without their blocks (not "auto") give None
        unpacked = packed.weight()
        return (unpacked, packed.bias) if unpacked is not None and unpacked.dtype == torch.float32 else None
    weight = getattr(module, "weight", None)
    if packed is None and isinstance(weight, torch.Tensor) and weight.numel() > 0 \
            and weight.dtype == torch.float32:
        return weight, module.effective_bias() if isinstance(module, LinearBase) else None
    return None


def with_high_precision(model: nn.Module, *, replace: bool = False) -> int:
    """Give the model's float32 linears their bf16x3 kernel; returns how many have one (none: a warning).

    replace=False (float32_matmul_precision "auto"): beside the IEEE kernel, as LinearBase.packed_high, for
    the steps whose context asks for it (embeddings); a layer that has one keeps it. replace=True ("high"):
    as the kernel of every step, the LM head's too, in place of the panels. Layers whose weight is in
    neither form (BATCHINFER_CPU_LINEAR=onednn: oneDNN's opaque layout) keep their IEEE kernel.
    """
    count = _attach_bf16x3(model, replace=replace) if amx_extension() is not None else 0
    if count == 0:
        logger.warning("float32_matmul_precision=%s: no linear runs bf16x3 here (native kernels not built or "
                       "refused AMX's tile state); IEEE float32 runs", "high" if replace else "auto")
    return count


def _attach_bf16x3(model: nn.Module, *, replace: bool) -> int:
    from batchinfer.engine.layers.embed_head import ParallelLMHead
    from batchinfer.engine.layers.linear import LinearBase

    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase | ParallelLMHead):
            continue
        if isinstance(module, ParallelLMHead) and not replace:
            continue  # embeddings pool hidden states: the head never runs there
        if isinstance(module, LinearBase) and module.packed_high is not None:
            count += 1
            continue
        found = dense_weight(module)
        kernel = None if found is None else amx_linear(*found)
        if kernel is None:
            continue
        if replace:
            module.packed = kernel
        elif isinstance(module, LinearBase):
            module.packed_high = kernel
        count += 1
    return count
