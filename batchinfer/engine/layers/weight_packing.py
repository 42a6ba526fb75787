"""CPU weight formats of the linear layers and the LM head, chosen once after the weights are loaded.

Why: on this project's CPUs (AMD EPYC) torch's fp32 F.linear goes to MKL, which takes a slow generic path on
non-Intel CPUs; oneDNN's JIT kernels run the same fp32 GEMMs 2.5-4.5x faster (the LM head of SmolLM2-135M at 8
rows: 12 ms -> 2.6 ms), and with a weight prepacked into oneDNN's blocked layout bf16 runs another 1.2-1.8x
faster than bf16 F.linear; our panel GEMM (below) beats oneDNN at decode sizes, so it is the default where
measured (AVX2-only CPUs; float32 on AVX-512 CPUs with AMX). int8 (quantization="int8") stores each weight
per output channel in int8 and runs fbgemm's dynamic-quantized GEMM (activations quantized per call and per
tensor): 1.5-2x bf16's speed at the batch sizes of a decode step; on a CPU with AMX tiles oneDNN's
(int8_gemm_engine). Its error is mostly the
per-tensor activation scale (weight-only int8 alone keeps the KL to fp32 at ~0.004), so two things keep it
in check: int8_smoothing folds per-channel activation smoothing into the weights once at load (channel
outliers of the norm outputs and of v), and down_proj's input, whose outliers sit on a few tokens rather
than in a few channels, is quantized per token (each row scaled to max 1 around the per-tensor GEMM). On
SmolLM2-135M without VNNI that takes bench/quality.py's fixed-text mean log-prob from 32% off fp32 to 2.3%.
The LM head is int8 too (about 1% of that delta).

On an AVX2-only CPU (no AVX-512: oneDNN has no brgemm there) float32 and bfloat16 weights go to our own
panel GEMM (PanelLinear, csrc/panel_gemm.cpp): oneDNN's AVX2 GEMM paid a decode step's weight
traffic and its arithmetic one after the other, the panel GEMM streams each weight once per step beside
the arithmetic (a step's 121 GEMMs of SmolLM2 on the AVX2 bench machine: 24 vs 36 ms at 1 row, 70 vs 95 ms
at 32, 176 vs 262 ms at 96), and a bf16 weight stays bf16 in memory, widened in registers. On an AVX-512
CPU it runs float32 (14 x 32 tiles; panel_gemm_preferred says why and where not).

pack_linears(model, kernels) sets each LinearBase / ParallelLMHead's `packed` callable (x -> y with its
bias), the kernel the weight format chooses (layers/quantization.py: dense, int8, gguf); the modules fall
back to F.linear when it is None (CUDA, float16, BATCHINFER_CPU_LINEAR=aten). bf16 on a CPU whose oneDNN
has no bf16 GEMM (AVX2-only) with BATCHINFER_CPU_LINEAR=onednn runs oneDNN's fp32 GEMM over the widened
weight (OneDnnLinear): plain bf16 F.linear there ran SmolLM2 at 0.19x OpenVINO's default.
The dense weight of a packed linear is released (the LM head's stays: it may be the tied embedding).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.cpu_attention import fused_ops_for
from batchinfer.engine.native.cpu_features import CPU_LINEAR_ENV, cpu_flags, cpu_has_vnni

# "auto" (default: "panel" on AVX2-only CPUs, and for float32 on AVX-512 ones; else "onednn"), "onednn",
# "panel" or "aten" (plain F.linear)
CPU_LINEAR_MODES = ("auto", "onednn", "panel", "aten")
# int8's GEMM, torch's quantized engine the weights are packed for: "auto" (default: "onednn" on a CPU with
# AMX int8 tiles, else "fbgemm"), "fbgemm" or "onednn"
INT8_GEMM_ENV = "BATCHINFER_CPU_INT8_GEMM"
INT8_GEMM_ENGINES = ("auto", "fbgemm", "onednn")
PANEL_DTYPES = (torch.float32, torch.bfloat16)  # the weight dtypes pack_panels keeps

TINY_ROW_MAX = 1e-12  # an all-zero row divides by this instead of 0 (it stays all zero)

LinearFn = Callable[[torch.Tensor], torch.Tensor]


class OneDnnLinear:
    """x -> x @ weight.T + bias through oneDNN with the weight reordered once into its blocked layout.

    A class rather than a closure so that worker/native_step.py can hand the packed weight to the C++
    decoder stack (the same GEMM, called without Python). compute_dtype float32 over a bf16 weight is
    bf16 on a CPU whose oneDNN has no bf16 GEMM (AVX2-only): the weight is widened once (exactly: a bf16
    is the high half of a float32), x is widened per call and the output rounded back to x's dtype. A
    product of two bf16 values is exact in float32 and oneDNN's bf16 GEMM accumulates in float32 too, so
    this is that GEMM (up to summation order) at fp32 GEMM speed, with the weight at twice bf16's size.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype | None = None) -> None:
        dtype = weight.dtype if compute_dtype is None else compute_dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), None)
        self.bias = None if bias is None else bias.detach().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the engine's activations are [T, features]; keep any other caller working
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        # .to is a no-op (the same tensor) unless this is a widened bf16 GEMM
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.packed.dtype), self.packed, self.bias, "none", [],
                                               "")
        return y.to(x.dtype)


class PanelLinear:
    """x -> x @ weight.T + bias through the panel GEMM (csrc/panel_gemm.cpp) over the weight packed once.

    The weight keeps its dtype (float32 or bfloat16, widened in registers); the arithmetic is float32 and
    the output comes back in x's dtype. A class so that worker/native_step.py can hand the panels to the
    C++ decoder stack (the same GEMM, called without Python).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, extension: Any) -> None:
        self.panels = extension.pack_panels(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features = int(weight.shape[0])
        self._extension = extension

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the engine's activations are [T, features]; keep any other caller working
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return self._extension.panel_linear(x, self.panels, self.bias, self.out_features)

    def weight(self) -> torch.Tensor:
        """The [N, K] weight again, exactly (a view of the panels: pack_panels' inverse)."""
        # [P, K, 16]: element (p, k, j) is W[16 p + j, k]
        return self.panels.transpose(1, 2).reshape(-1, self.panels.shape[1])[: self.out_features]


def panel_extension() -> Any:
    """The native extension when its panel GEMM is built here (AVX2 + FMA), else None."""
    ext = cpu_attention.load()
    return ext if ext is not None and hasattr(ext, "panel_gemm_built") and ext.panel_gemm_built() else None


def panel_gemm_preferred(dtype: torch.dtype) -> bool:
    """True where "auto" picks the panel GEMM for weights of this dtype (its build has it: AVX2 + FMA):
    float32 / bfloat16 on a CPU without AVX-512, float32 on an AVX-512 one.

    Its 14-row x 32-column AVX-512 tile beat oneDNN's fp32 GEMM over a SmolLM2 step on both AVX-512 CPUs
    measured (bench/panel_gemm.py): on an AMX Xeon 1.06-1.43x from 1 to 256 rows, 0.95x at 512; on an
    AVX-512 EPYC (Zen 4: half-width FMAs, 1 MiB L2) 1.12-1.66x from 1 to 96 rows, 0.97-1.09x from 128 to
    1024. The chat bench ran 1.18-1.23x (Xeon) and 1.04x (EPYC) faster, bench/embeddings.py level on both
    (EPYC: 97.4 / 92.3 s against oneDNN's 98.8 / 92.4 s). bf16 on AVX-512 stays on oneDNN's bf16 GEMM
    (avx512_bf16 / AMX dot products; the panel GEMM widens to float32).
    """
    if dtype not in PANEL_DTYPES or panel_extension() is None:
        return False
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return False
    return "avx512f" not in flags or dtype == torch.float32


def panel_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn | None:
    """x -> x @ weight.T + bias through the panel GEMM (PanelLinear), or None where it cannot run."""
    ext = panel_extension()
    if ext is None or weight.dtype not in PANEL_DTYPES:
        return None
    return PanelLinear(weight, bias, ext)


def cpu_linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn | None:
    """The dense CPU kernel BATCHINFER_CPU_LINEAR picks for one linear, or None to keep F.linear.

    "panel" where the panel GEMM cannot run (no AVX2 build, float16) falls back to oneDNN.
    """
    mode = cpu_linear_mode(weight.dtype)
    if mode == "aten":
        return None
    if mode == "panel" and (kernel := panel_linear(weight, bias)) is not None:
        return kernel
    return onednn_linear(weight, bias)


def onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn | None:
    """x -> x @ weight.T + bias through oneDNN's prepacked GEMM (OneDnnLinear), or None where it cannot.

    bf16 where oneDNN has no bf16 GEMM runs as widened fp32 (OneDnnLinear's compute_dtype); other
    dtypes oneDNN does not run here (float16) keep F.linear.
    """
    if onednn_supports(weight.dtype):
        return OneDnnLinear(weight, bias)
    if weight.dtype == torch.bfloat16 and onednn_supports(torch.float32):
        return OneDnnLinear(weight, bias, compute_dtype=torch.float32)
    return None


class Int8Linear:
    """x -> x @ dequant(W_int8).T + bias: per-output-channel symmetric int8 weights, a dynamic int8 GEMM.

    Activations are quantized per call (per tensor, asymmetric uint8); full range with VNNI, 7 bits
    without it (AVX2 sums u8 x s8 pairs in saturating int16: full-range activations overflow there, a
    10% error). per_token: each row of x is divided by its max |x| before the GEMM and its output row
    multiplied back, so a row with outliers no longer sets the quantization step of the others (an
    elementwise pass over x and y; the bias is added after). The output comes back in x's dtype.
    The weight is packed for int8_gemm_engine()'s kernel (fbgemm, or oneDNN's AMX tiles); both quantize the
    activations the same way, so they differ only in summation order. A class so that
    worker/native_step.py can hand its packed weight to the C++ decoder stack.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, per_token: bool = False) -> None:
        self.reduce_range = not cpu_has_vnni()
        self.per_token = per_token
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        self.float_bias = None if bias is None else bias.detach().float()
        with warnings.catch_warnings():  # quantize_per_channel is deprecated upstream; fbgemm still needs it
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
            # the engine's LinearPackedParamsBase (a torch.ScriptObject); per tensor it holds the bias too.
            # linear_dynamic runs whichever engine packed it, whatever the global engine is at call time.
            with quantized_engine(int8_gemm_engine()):
                self.packed = torch.ops.quantized.linear_prepack(qweight,
                                                                 None if per_token else self.float_bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        if self.per_token:
            ops = fused_ops_for(flat)
            if ops is not None and flat.is_contiguous():
                scaled, row_max = ops.scale_rows(flat, TINY_ROW_MAX)  # one pass instead of four ops
            else:
                row_max = flat.abs().amax(dim=1, keepdim=True).clamp_(min=TINY_ROW_MAX)
                scaled = flat / row_max
            out = torch.ops.quantized.linear_dynamic(scaled, self.packed, self.reduce_range).mul_(row_max)
            if self.float_bias is not None:
                out += self.float_bias
        else:
            out = torch.ops.quantized.linear_dynamic(flat, self.packed, self.reduce_range)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, per_token: bool = False) -> LinearFn:
    """x -> x @ dequant(W_int8).T + bias through a dynamic int8 GEMM (Int8Linear)."""
    return Int8Linear(weight, bias, per_token)


def int8_gemm_engine() -> str:
    """BATCHINFER_CPU_INT8_GEMM, validated and resolved: the quantized engine int8 weights are packed for.

    "auto" is oneDNN on a CPU with AMX int8 tiles: its AMX GEMM ran a SmolLM2 step's int8 GEMMs 1.5-2.6x
    faster than fbgemm's AVX-512 VNNI from 32 rows up (fbgemm is faster at 1-8 rows; 5.5 vs 3.2 ms at 1).
    Elsewhere fbgemm, as before (oneDNN's int8 GEMM was measured only on an AMX CPU).
    """
    engine = os.environ.get(INT8_GEMM_ENV, "auto")
    if engine not in INT8_GEMM_ENGINES:
        raise ValueError(f"{INT8_GEMM_ENV} must be one of {', '.join(INT8_GEMM_ENGINES)}; got {engine!r}")
    supported = torch.backends.quantized.supported_engines
    if engine == "auto":
        return "onednn" if "amx_int8" in cpu_flags() and "onednn" in supported else "fbgemm"
    if engine not in supported:
        raise ValueError(f"{INT8_GEMM_ENV}={engine} needs torch's {engine} quantized engine, absent from "
                         f"this build (it has {', '.join(supported)}); unset it to let auto choose")
    return engine


_QUANTIZED_ENGINE_LOCK = threading.Lock()  # the engine is process-wide: one packer sets it at a time


@contextlib.contextmanager
def quantized_engine(engine: str) -> Iterator[None]:
    """torch's global quantized engine set to `engine` in the block (prepacking reads it), then restored."""
    with _QUANTIZED_ENGINE_LOCK:
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = engine
        try:
            yield
        finally:
            torch.backends.quantized.engine = previous


def onednn_supports(dtype: torch.dtype) -> bool:
    """True when oneDNN runs this dtype's GEMMs here (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def cpu_linear_mode(dtype: torch.dtype = torch.float32) -> str:
    """BATCHINFER_CPU_LINEAR, validated and resolved for weights of dtype: 'onednn', 'panel' or 'aten'."""
    mode = os.environ.get(CPU_LINEAR_ENV, "auto")
    if mode not in CPU_LINEAR_MODES:
        raise ValueError(f"{CPU_LINEAR_ENV} must be one of {', '.join(CPU_LINEAR_MODES)}; got {mode!r}")
    if mode == "auto":
        return "panel" if panel_gemm_preferred(dtype) else "onednn"
    return mode


class LinearKernels(Protocol):
    """What pack_linears asks a weight format (engine/layers/quantization.py) for each linear."""

    def per_token_layers(self, model: nn.Module) -> set[nn.Module]: ...

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *,
               per_token: bool) -> LinearFn | None: ...


def pack_linears(model: nn.Module, kernels: LinearKernels,
                 already_packed: set[nn.Module] | frozenset[nn.Module] = frozenset()) -> int:
    """Give every linear layer and the LM head the format's CPU kernel; returns how many were packed.

    Modules in already_packed have their kernel (gguf's blocks); only their dense weight is released.
    """
    from batchinfer.engine.layers.embed_head import ParallelLMHead
    from batchinfer.engine.layers.linear import LinearBase

    per_token = kernels.per_token_layers(model)
    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase | ParallelLMHead):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.numel() == 0:
            continue
        bias = module.effective_bias() if isinstance(module, LinearBase) else None
        if module in already_packed:
            pass  # its kernel is set; release its dense weight below
        elif (kernel := kernels.linear(weight, bias, per_token=module in per_token)) is not None:
            module.packed = kernel
        else:
            continue
        if isinstance(module, LinearBase):  # the head's weight may be the embedding table: keep it
            weight.data = weight.data.new_empty(0)
            if module.bias is not None:
                module.bias.data = module.bias.data.new_empty(0)
        count += 1
    return count
