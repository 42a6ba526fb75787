"""Rotary position embeddings (NeoX/Llama "rotate half" layout) with the Llama-family scaling variants.

The rope settings are read from `config.rope_parameters` (transformers >= 5) or the older
`config.rope_scaling` + `config.rope_theta`. Frequencies are computed exactly as transformers does, so
fp32 logits match it; cos/sin for every position up to max_position are precomputed once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Required, TypedDict, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeSettings(TypedDict, total=False):
    """A config's rope dict: the keys of transformers' rope_parameters that the scaling variants read."""

    rope_type: Required[str]
    rope_theta: Required[float]
    factor: float
    partial_rotary_factor: float
    low_freq_factor: float  # llama3
    high_freq_factor: float
    original_max_position_embeddings: int
    attention_factor: float  # yarn
    mscale: float
    mscale_all_dim: float
    beta_fast: float
    beta_slow: float
    truncate: bool


def rope_settings(hf_config: PretrainedConfig) -> RopeSettings:
    """The rope dict of a config ({'rope_type', 'rope_theta', ...}), whichever transformers wrote it."""
    params: dict[str, object] = dict(getattr(hf_config, "rope_parameters", None) or {})
    # Per-layer-type nesting ({"full_attention": {...}}) is not used by the Llama family.
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return cast(RopeSettings, params)  # the config's JSON, as transformers keeps it


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(params: RopeSettings, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(params: RopeSettings, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def compute_inv_freq(
    params: RopeSettings, rotary_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], attention scaling of cos/sin) for a rope dict."""
    rope_type = params["rope_type"]
    if rope_type == "default":
        return _default_inv_freq(params["rope_theta"], rotary_dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(params["rope_theta"], rotary_dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(params, rotary_dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, rotary_dim, max_position_embeddings)
    raise ValueError(
        f"rope_type {rope_type!r} in the model config (rope_parameters / rope_scaling) is not supported; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to packed q [T, H, D] and k [T, Hkv, D] at the given absolute positions."""

    cos_cache: torch.Tensor  # buffers registered in __init__
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: RopeSettings,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        partial = params.get("partial_rotary_factor", 1.0)
        self.rotary_dim = int(head_dim * partial)
        if self.rotary_dim != head_dim:
            raise ValueError("partial_rotary_factor != 1 is not supported by the Llama family implementation")
        inv_freq, scaling = compute_inv_freq(params, self.rotary_dim, max_position_embeddings or max_position)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # same products as transformers' position * inv_freq
        self.register_buffer("cos_cache", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, rotary_dim / 2] of the given positions (once per step, for all layers)."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        return cos, self.sin_cache[positions].unsqueeze(1).to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k (views of [T, heads, D]); returns new tensors in their dtype."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, k, cos, sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by precomputed cos/sin [T, 1, D / 2]."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotate_qkv_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_rotated_heads: int, head_dim: int
) -> bool:
    """Rotate the first num_rotated_heads heads (q then k) of each row of qkv [T, ...] in place.

    True when the fused CPU kernel did it; False (qkv untouched) where it does not apply: use apply_rotary.
    """
    from batchinfer.engine.layers.cpu_attention import fused_ops_for

    ops = fused_ops_for(qkv)
    if ops is None or qkv.dim() != 2 or qkv.stride(1) != 1 or cos.dtype != qkv.dtype:
        return False
    ops.rotary_(qkv, cos.contiguous(), sin.contiguous(), num_rotated_heads, head_dim)
    return True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): transformers' x*cos + rotate_half(x)*sin, term by term.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def get_rope(hf_config: PretrainedConfig, head_dim: int, max_position: int) -> RotaryEmbedding:
    """The rotary embedding of a Llama-family config, precomputed for positions [0, max_position)."""
    settings = rope_settings(hf_config)
    return RotaryEmbedding(head_dim, max_position, settings, hf_config.max_position_embeddings)
