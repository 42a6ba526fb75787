"""A PEFT LoRA adapter directory -> per-layer weights in the engine's fused layouts, checked at load.

PEFT saves, per adapted projection P of layer i, `...layers.{i}.{self_attn|mlp}.{P}.lora_A.weight` [r, in]
and `...lora_B.weight` [out, r]; the delta of P is scaling * x @ A.T @ B.T with scaling = lora_alpha / r
(lora_alpha / sqrt(r) under use_rslora). The engine fuses q/k/v into qkv_proj and gate/up into
gate_up_proj, so an adapter is stored per engine module as one pair:

    a [R, in]    the A of each adapted slice stacked along the rank (R = the sum of their ranks)
    b [out, R]   block-diagonal: slice s's rows of the fused output take scaling_s * B_s in s's rank columns

so x @ a.T @ b.T is the fused module's whole delta in two matmuls; a slice the adapter leaves alone has no
rank columns (its output rows get exact zeros). Under tensor parallelism each rank keeps its share, as the
base weight is split: a column-parallel module (qkv, gate_up) keeps all of A and its output rows of B (KV
rows chosen like the base's, replicated KV heads included); a row-parallel one (o, down) keeps its input
columns of A and all of B, so the ranks' partial deltas, added before the all-reduce, sum to the delta.

Everything an adapter could get wrong (missing files, a rank above max_lora_rank, another base model's
shapes, DoRA, biases, other modules) is a LoRAError here, naming the file or tensor, before any request
runs under it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchinfer.engine.layers.partition import local_kv_heads
from batchinfer.engine.model_files import JsonObject

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT target module -> (engine module, slice index within it)
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot run on this engine's model; `field` names what is wrong (a file, a tensor)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class ModuleLayout:
    """One engine module an adapter can target: its input width and the output widths of its slices."""

    input_size: int
    output_sizes: tuple[int, ...]


ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # input features split across ranks (the rest: output)


def module_layouts(hf_config: PretrainedConfig, tp_size: int = 1) -> dict[str, ModuleLayout]:
    """Engine module name -> its layout on one of tp_size ranks, from the base model's config."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    q, kv = heads // tp_size * head_dim, local_kv_heads(kv_heads, tp_size) * head_dim
    return {
        "qkv_proj": ModuleLayout(hidden, (q, kv, kv)),
        "o_proj": ModuleLayout(heads * head_dim // tp_size, (hidden,)),
        "gate_up_proj": ModuleLayout(hidden, (inter // tp_size, inter // tp_size)),
        "down_proj": ModuleLayout(inter // tp_size, (hidden,)),
    }


def _rank_share(module: str, index: int, a: torch.Tensor, b: torch.Tensor, local: ModuleLayout,
                tp_rank: int, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of one slice: A's input columns (row-parallel) or B's output rows (column)."""
    if tp_size == 1:
        return a, b
    if module in ROW_PARALLEL:
        width = local.input_size
        return a[:, tp_rank * width : (tp_rank + 1) * width], b
    rows = local.output_sizes[index]
    shard = tp_rank
    if module == "qkv_proj" and index > 0:  # K / V: the base's choice of KV head (replicated when few)
        num_shards = b.shape[0] // rows
        shard = tp_rank * num_shards // tp_size
    return a, b[shard * rows : (shard + 1) * rows]


@dataclass
class LoRALayerWeights:
    """The delta of one engine module under one adapter: x @ a.T @ b.T (scaling folded into b)."""

    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R]


@dataclass
class LoRAAdapter:
    """A loaded adapter: weights keyed by "layers.{i}.{engine module}", plus what describes it."""

    name: str
    path: str
    rank: int  # the largest rank of any adapted projection
    weights: dict[str, LoRALayerWeights] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        """Memory held by this adapter's weights."""
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def read_adapter_config(path: Path) -> JsonObject:
    """adapter_config.json, checked for the options this engine runs (LoRA, no DoRA, no bias, ...)."""
    config_file = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise LoRAError("lora_path", f"{path} is not a directory (a PEFT adapter directory holds "
                                     f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    if not config_file.is_file():
        raise LoRAError("lora_path", f"{config_file} is missing: not a PEFT adapter directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(ADAPTER_CONFIG, f"cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(ADAPTER_CONFIG, "must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{ADAPTER_CONFIG}: peft_type", f"only LORA adapters run here; got {peft_type!r}")
    if config.get("use_dora"):
        raise LoRAError(f"{ADAPTER_CONFIG}: use_dora", "DoRA adapters are not supported; merge the "
                        "adapter into the base model, or train it without use_dora")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{ADAPTER_CONFIG}: bias", f"adapters that train biases are not supported; got "
                        f"{config.get('bias')!r} (only 'none')")
    if config.get("modules_to_save"):
        raise LoRAError(f"{ADAPTER_CONFIG}: modules_to_save", "fully trained modules "
                        f"{config['modules_to_save']} are not supported (only LoRA A/B pairs)")
    if config.get("fan_in_fan_out"):
        raise LoRAError(f"{ADAPTER_CONFIG}: fan_in_fan_out", "must be false for Llama-family models")
    if config.get("alpha_pattern"):
        raise LoRAError(f"{ADAPTER_CONFIG}: alpha_pattern", "per-module lora_alpha is not supported")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAError(f"{ADAPTER_CONFIG}: lora_alpha", f"must be a positive number; got {alpha!r}")
    return config


def max_adapter_bytes(
    hf_config: PretrainedConfig, *, max_lora_rank: int, itemsize: int, tp_size: int = 1
) -> int:
    """The most one loaded adapter can take on a rank: rank max_lora_rank on all seven projections."""
    total = 0
    for layout in module_layouts(hf_config, tp_size).values():
        rank = max_lora_rank * len(layout.output_sizes)  # fused slices stack their ranks
        total += rank * (layout.input_size + sum(layout.output_sizes))
    return total * hf_config.num_hidden_layers * itemsize


def adapter_fingerprint(path: str | Path) -> str:
    """sha256 of an adapter's config and weights files: what a result cache or provenance record should key
    an adapter's outputs on (its served name may point at other weights tomorrow)."""
    import hashlib

    digest = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        digest.update(name.encode())
        with open(Path(path) / name, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def lora_scaling(config: JsonObject, rank: int) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) when the adapter was trained with use_rslora."""
    lora_alpha = config["lora_alpha"]
    if not isinstance(lora_alpha, int | float):  # read_adapter_config refuses such a config first
        raise LoRAError(f"{ADAPTER_CONFIG}: lora_alpha", f"must be a positive number; got {lora_alpha!r}")
    alpha = float(lora_alpha)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_adapter(
    name: str,
    path: str | Path,
    *,
    hf_config: PretrainedConfig,
    max_lora_rank: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> LoRAAdapter:
    """Read a PEFT adapter directory into the fused layouts of `hf_config`'s model; LoRAError if unfit.

    tp_rank / tp_size: the share of one tensor-parallel rank (module docstring); shapes are checked whole.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_adapter_config(path)
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        hint = " (adapter_model.bin found: re-save it with safe_serialization=True)" \
            if (path / "adapter_model.bin").is_file() else ""
        raise LoRAError("lora_path", f"{weights_file} is missing{hint}")
    try:
        tensors = load_file(str(weights_file))
    except SafetensorError as exc:  # not a ValueError: it would escape as a traceback, not a line error
        raise LoRAError(ADAPTER_WEIGHTS, f"cannot be read as safetensors ({exc}): a damaged or partial "
                        "copy? copy the adapter again") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise LoRAError(tensor_name, "not a LoRA A/B weight of q/k/v/o/gate/up/down_proj of a decoder "
                            "layer: this engine adapts only those (no embeddings, lm_head, biases or DoRA)")
        layer = int(match.group(1))
        if layer >= hf_config.num_hidden_layers:
            raise LoRAError(tensor_name, f"layer {layer} does not exist: the base model has "
                            f"{hf_config.num_hidden_layers} layers (an adapter for another base model?)")
        pairs.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    if not pairs:
        raise LoRAError(ADAPTER_WEIGHTS, "holds no LoRA weights")
    layouts = module_layouts(hf_config)
    local_layouts = module_layouts(hf_config, tp_size)
    slices: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    max_rank = 0
    for (layer, target), pair in sorted(pairs.items()):
        prefix = f"model.layers.{layer}.{target}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(f"{prefix}.{missing}.weight",
                            "is missing (each adapted projection needs A and B)")
        a, b = pair["A"], pair["B"]
        module, index = TARGET_MODULES[target]
        layout = layouts[module]
        rank = a.shape[0]
        expected_a = (rank, layout.input_size)
        expected_b = (layout.output_sizes[index], rank)
        if a.dim() != 2 or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise LoRAError(f"{prefix}.lora_A/B.weight", f"shapes {tuple(a.shape)} / {tuple(b.shape)} do "
                            f"not fit the base model, which expects {expected_a} / {expected_b}: "
                            "an adapter trained for another base model?")
        if rank > max_lora_rank:
            raise LoRAError(f"{prefix}.lora_A.weight", f"rank {rank} exceeds max_lora_rank={max_lora_rank}; "
                            f"raise max_lora_rank (--max-lora-rank) to at least {rank}")
        max_rank = max(max_rank, rank)
        a, b = _rank_share(module, index, a, b, local_layouts[module], tp_rank, tp_size)
        scaled_b = b.to(torch.float32) * lora_scaling(config, rank)
        slices.setdefault((layer, module), {})[index] = (a.to(torch.float32), scaled_b)
    adapter = LoRAAdapter(name=name, path=str(path), rank=max_rank)
    for (layer, module), parts in slices.items():
        a, b = _fuse(parts, local_layouts[module])
        adapter.weights[f"layers.{layer}.{module}"] = LoRALayerWeights(
            a.to(dtype=dtype, device=device).contiguous(), b.to(dtype=dtype, device=device).contiguous()
        )
    return adapter


def _fuse(
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]], layout: ModuleLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slices' (A, scaled B) pairs as one (a [R, in], block-diagonal b [out, R]) of the fused module."""
    a = torch.cat([parts[i][0] for i in sorted(parts)], dim=0)
    b = torch.zeros(sum(layout.output_sizes), a.shape[0], dtype=torch.float32)
    row_offsets = [sum(layout.output_sizes[:i]) for i in range(len(layout.output_sizes))]
    col = 0
    for i in sorted(parts):
        part_b = parts[i][1]
        b[row_offsets[i] : row_offsets[i] + part_b.shape[0], col : col + part_b.shape[1]] = part_b
        col += part_b.shape[1]
    return a, b
