"""CPU weight formats of the linear layers and the LM head, chosen once after the weights are loaded.

Why: on this project's CPUs (AMD EPYC) torch's fp32 F.linear goes to MKL, which takes a slow generic path
on non-Intel CPUs; oneDNN's JIT kernels use AVX-512 there and run the same fp32 GEMMs 2.5-4.5x faster (the
LM head of SmolLM2-135M at 8 rows: 12 ms -> 2.6 ms), and with a weight prepacked into oneDNN's blocked
layout bf16 runs another 1.2-1.8x faster than bf16 F.linear. int8 (quantization="int8") stores each weight
per output channel in int8 and runs fbgemm's dynamic-quantized GEMM (activations quantized per call and
per tensor, VNNI): 1.5-2x bf16's speed at the batch sizes of a decode step. Its error is mostly the
per-tensor activation scale (weight-only int8 alone keeps the KL to fp32 at ~0.004; with activations it is
~0.08, mean log-prob of a fixed text within 2.4% of fp32); the LM head is int8 too (it costs no quality).

pack_for_cpu(model, quantization) sets each LinearBase / ParallelLMHead's `packed` callable (x -> y with
its bias); the modules fall back to F.linear when it is None (CUDA, float16, BATCHINFER_CPU_LINEAR=aten).
The dense weight of a packed linear is released (the LM head's stays: it may be the tied embedding).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
from torch import nn

from batchinfer.engine.config import QUANTIZATIONS

CPU_LINEAR_ENV = "BATCHINFER_CPU_LINEAR"  # "onednn" (default) or "aten" (plain F.linear, for A/B runs)
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)

LinearFn = Callable[[torch.Tensor], torch.Tensor]


def onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn:
    """x -> x @ weight.T + bias through oneDNN with the weight reordered once into its blocked layout."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    bias = None if bias is None else bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the engine's activations are [T, features]; keep any other caller working
            return forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn:
    """x -> x @ dequant(W_int8).T + bias: per-output-channel symmetric int8 weights, fbgemm dynamic GEMM.

    Activations are quantized per call (per tensor, asymmetric uint8, full range: VNNI has no overflow);
    the output comes back in x's dtype.
    """
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantize_per_channel is deprecated upstream; fbgemm still needs it
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        out = torch.ops.quantized.linear_dynamic(flat, packed, False)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    return forward


def cpu_linear_mode() -> str:
    """BATCHINFER_CPU_LINEAR, validated: 'onednn' (default) or 'aten'."""
    mode = os.environ.get(CPU_LINEAR_ENV, "onednn")
    if mode not in ("onednn", "aten"):
        raise ValueError(f"{CPU_LINEAR_ENV} must be 'onednn' or 'aten'; got {mode!r}")
    return mode


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """A clear error for a quantization this engine cannot run on this device."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization: must be None or one of {', '.join(QUANTIZATIONS)}; got {quantization!r}"
        )
    if device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only (fbgemm); got device {device}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError(f"quantization={quantization!r} needs torch's fbgemm engine, absent from this build")


def pack_weights(model: nn.Module, device: torch.device, quantization: str | None = None) -> int:
    """Give every linear layer and the LM head its CPU kernel (nothing on CUDA); returns how many."""
    check_quantization(quantization, device)
    if device.type != "cpu":
        return 0
    return pack_for_cpu(model, quantization)


def pack_for_cpu(model: nn.Module, quantization: str | None = None) -> int:
    """Give every linear layer and the LM head its CPU kernel; returns how many modules were packed."""
    from batchinfer.engine.layers.embed_head import ParallelLMHead
    from batchinfer.engine.layers.linear import LinearBase

    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase | ParallelLMHead):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.numel() == 0:
            continue
        bias = module.effective_bias() if isinstance(module, LinearBase) else None
        if quantization == "int8":
            module.packed = int8_linear(weight, bias)
        elif weight.dtype in ONEDNN_DTYPES and cpu_linear_mode() == "onednn":
            module.packed = onednn_linear(weight, bias)
        else:
            continue
        if isinstance(module, LinearBase):  # the head's weight may be the embedding table: keep it
            weight.data = weight.data.new_empty(0)
            if module.bias is not None:
                module.bias.data = module.bias.data.new_empty(0)
        count += 1
    return count
