"""SmoothQuant-style activation smoothing for quantization="int8", folded into the weights once at load.

Why: the int8 GEMMs quantize each activation per tensor (one scale per call), so a few input channels with
large magnitudes (the norm outputs and the SwiGLU product of Llama-family models have channels 10-100x
the median) set the scale and leave the other channels a handful of levels; without VNNI the activation
range is 7 bits (weight_packing.int8_linear), which makes it worse. Smoothing divides input channel j of
each linear by s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) and multiplies weight column j by s_j: the
product is unchanged, the activation outliers shrink and the weights (quantized per output channel, easy)
take part of the range. The division is folded exactly into whatever produces X, so a step costs nothing:

  qkv_proj      <- input_layernorm.weight            (the norm's output is weight * x / rms(x))
  gate_up_proj  <- post_attention_layernorm.weight
  down_proj     <- the "up" rows of gate_up_proj     (silu(gate) * up is linear in up)
  o_proj        <- the v rows of qkv_proj            (attention output is linear in v; with GQA one s per
                                                      (kv head, dim), the max over the q heads of a group)

Smoothing alone leaves down_proj far off (SmolLM2-135M: fixed-text mean log-prob 11% off fp32, from 32%):
the outliers of silu(gate) * up sit on a few tokens (the first one: 2800 next to a median row maximum of
1.4) more than in a few channels, which no per-channel factor can fix. per_token_input_layers names those
layers, and weight_packing quantizes their input per token (2.3% off fp32 with both; per token alone 10%).
The LM head is left out: its input is the final norm, whose output is also the runner's embedding (embed)
and whose table may be the tied embedding. max|X_j| comes from one dense forward of the float model over a
built-in calibration text (prose, a chat exchange, code), deliberately not the text the quality bench
scores. Smoothing needs the whole model on one rank (no tensor or pipeline parallelism); otherwise
the plain int8 path runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from batchinfer.engine.layers.context import AttentionContext, set_context
from batchinfer.engine.layers.linear import LinearBase
from batchinfer.engine.parallel.distributed import tp_world_size

if TYPE_CHECKING:  # the smoothed model is Llama's; imported for types only (models import layers)
    from batchinfer.engine.layers.norm import RMSNorm
    from batchinfer.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

SMOOTHING_ALPHA = 0.5  # share of the activation range moved into the weights (0: none, 1: all)
# Bounds of s_j: a channel the calibration text barely touches must not get a huge weight column (and a
# tiny norm weight) that an unseen input would then overflow.
SMOOTHING_MIN, SMOOTHING_MAX = 1e-2, 1e2
MAGNITUDE_FLOOR = 1e-5  # |x| and |w| maxima below this count as this (no division by zero)

CALIBRATION_TEXT = (
    "Mount Kilimanjaro rises almost six thousand metres above the plains of Tanzania, and climbers pass "
    "through five climate zones on the way up: farmland, rainforest, heath, alpine desert and finally the "
    "glaciers of the summit. Most routes take six to eight days, because the body needs time to adjust to "
    "the thin air. Porters carry tents, food and water; guides check each climber's pulse and oxygen every "
    "morning. In 1889 Hans Meyer and Ludwig Purtscheller were the first recorded climbers to reach the top.\n"
    "Q: What is the difference between a list and a tuple in Python?\n"
    "A: A list is mutable, so you can append, remove or change items after creating it. A tuple is "
    "immutable: once built it cannot change, which makes it hashable and usable as a dictionary key.\n"
    "User: Can you give me three tips for sleeping better?\n"
    "Assistant: Sure! 1. Go to bed and wake up at the same time every day. 2. Keep your bedroom dark, "
    "quiet and cool. 3. Avoid caffeine after lunch and screens in the last hour before bed.\n"
    "def moving_average(values: list[float], window: int = 3) -> list[float]:\n"
    "    \"\"\"Average of each run of `window` consecutive values.\"\"\"\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]\n\n"
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name;\n"
    "The invoice lists 14 items for a total of $1,237.50, due on 2024-03-31; late payments add 2% a month."
)
CALIBRATION_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a short poem about autumn leaves falling in a quiet park."},
    {"role": "assistant", "content": (
        "Golden leaves drift slowly down,\nA quiet carpet, red and brown;\n"
        "The benches wait, the paths lie still,\nAs autumn settles on the hill."
    )},
]


def smoothing_applies(model: nn.Module) -> bool:
    """True when the whole Llama-family model sits on this rank, float, on CPU (what the folds assume)."""
    inner = getattr(model, "model", None)
    stage = getattr(inner, "stage", None)
    if tp_world_size() != 1 or stage is None or not (stage.is_first and stage.is_last):
        return False
    layers = list(getattr(inner, "stage_layers", ()))
    return bool(layers) and all(_has_llama_layout(layer) for layer in layers) and all(
        p.device.type == "cpu" and p.dtype.is_floating_point for p in model.parameters()
    )


def _has_llama_layout(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (
        all(hasattr(attn, name) for name in ("qkv_proj", "o_proj", "num_heads", "num_kv_heads", "head_dim"))
        and all(hasattr(mlp, name) for name in ("gate_up_proj", "down_proj"))
        and all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm"))
    )


def per_token_input_layers(model: nn.Module) -> set[nn.Module]:
    """The linears whose input int8 should quantize per token: each decoder layer's down_proj."""
    layers = getattr(getattr(model, "model", None), "stage_layers", ())
    return {layer.mlp.down_proj for layer in layers if hasattr(getattr(layer, "mlp", None), "down_proj")}


def calibration_token_ids(model_path: str | Path, max_len: int) -> list[list[int]]:
    """The calibration inputs in the model's tokenizer (the plain text, and the chat in its template), each
    cut into pieces of at most max_len tokens (the model's context: its rotary table ends there)."""
    from batchinfer.engine.models.loader import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    sequences = [list(tokenizer(CALIBRATION_TEXT).input_ids)]
    if getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template(CALIBRATION_CHAT, tokenize=False)
        sequences.append(list(tokenizer(chat, add_special_tokens=False).input_ids))
    return [ids[start : start + max_len] for ids in sequences for start in range(0, len(ids), max_len)]


@torch.inference_mode()
def input_channel_maxima(
    model: nn.Module, token_id_lists: Sequence[list[int]]
) -> dict[nn.Module, torch.Tensor]:
    """Per-input-channel max |x| (float32) of every linear layer over dense forwards of the inputs."""
    maxima: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach()
        channel_max = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        previous = maxima.get(module)
        maxima[module] = channel_max if previous is None else torch.maximum(previous, channel_max)

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, LinearBase)]
    device = next(model.parameters()).device
    empty = torch.empty(0, dtype=torch.int32, device=device)
    try:
        for ids in token_id_lists:
            set_context(AttentionContext(empty, empty, empty, empty, len(ids), len(ids), "dense"))
            try:
                input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
                model(input_ids, torch.arange(len(ids), device=device))
            finally:
                set_context(None)
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def smoothing_factors(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), bounded to [SMOOTHING_MIN, SMOOTHING_MAX]."""
    x_max, w_max = x_max.clamp(min=MAGNITUDE_FLOOR), w_max.clamp(min=MAGNITUDE_FLOOR)
    return (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(SMOOTHING_MIN, SMOOTHING_MAX)


def _scale_(param: torch.Tensor, factor: torch.Tensor) -> None:
    """param *= factor (broadcast), computed in float32 and stored back in param's dtype."""
    param.copy_(param.float() * factor)


def _smooth_o_proj(attn: LlamaAttention, x_max: torch.Tensor, alpha: float) -> None:
    """o_proj columns (h, d) *= s[h // group, d]; v rows (kv head, d) /= s (one s per kv head and dim)."""
    qkv, o_proj = attn.qkv_proj, attn.o_proj
    kv_heads, dim = attn.num_kv_heads, attn.head_dim
    group = attn.num_heads // kv_heads
    x_kv = x_max.view(kv_heads, group, dim).amax(dim=1)
    w_kv = o_proj.weight.detach().float().abs().view(-1, kv_heads, group, dim).amax(dim=(0, 2))
    s = smoothing_factors(x_kv, w_kv, alpha)
    weight = o_proj.weight.data.view(-1, kv_heads, group, dim)
    _scale_(weight, s.view(1, kv_heads, 1, dim))
    v_start = (attn.num_heads + kv_heads) * dim
    _scale_(qkv.weight.data[v_start:], (1 / s).reshape(-1, 1))
    if qkv.bias is not None:
        _scale_(qkv.bias.data[v_start:], (1 / s).reshape(-1))


def _smooth_down_proj(mlp: LlamaMLP, x_max: torch.Tensor, alpha: float) -> None:
    """down_proj column j *= s_j; the up row j of gate_up_proj (and its bias) /= s_j."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    s = smoothing_factors(x_max, down.weight.detach().float().abs().amax(dim=0), alpha)
    _scale_(down.weight.data, s.view(1, -1))
    up_start = gate_up.weight.shape[0] - s.numel()
    _scale_(gate_up.weight.data[up_start:], (1 / s).view(-1, 1))
    if gate_up.bias is not None:
        _scale_(gate_up.bias.data[up_start:], 1 / s)


def _smooth_after_norm(norm: RMSNorm, linear: LinearBase, x_max: torch.Tensor, alpha: float) -> None:
    """linear column j *= s_j; the norm weight j (the only scale between x / rms(x) and the linear) /= s_j."""
    s = smoothing_factors(x_max, linear.weight.detach().float().abs().amax(dim=0), alpha)
    _scale_(linear.weight.data, s.view(1, -1))
    _scale_(norm.weight.data, 1 / s)


@torch.inference_mode()
def smooth_for_int8(model: nn.Module, token_id_lists: Sequence[list[int]], alpha: float | None = None) -> int:
    """Calibrate on the inputs, then fold every decoder linear's smoothing in; returns the layers smoothed.

    The float function is unchanged up to rounding. The inner folds (o_proj into v, down_proj into up) go
    first, so the norm-side factors see the weights qkv_proj and gate_up_proj will actually be quantized with.
    """
    alpha = SMOOTHING_ALPHA if alpha is None else alpha
    maxima = input_channel_maxima(model, token_id_lists)
    llama = cast("LlamaForCausalLM", model)
    layers = cast("list[LlamaDecoderLayer]", list(llama.model.stage_layers))
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        _smooth_o_proj(attn, maxima[attn.o_proj], alpha)
        _smooth_down_proj(mlp, maxima[mlp.down_proj], alpha)
        _smooth_after_norm(layer.input_layernorm, attn.qkv_proj, maxima[attn.qkv_proj], alpha)
        _smooth_after_norm(layer.post_attention_layernorm, mlp.gate_up_proj, maxima[mlp.gate_up_proj], alpha)
    return 4 * len(layers)
