"""Loading model weights into our modules, and the tokenizer (the model's files are found, and its config
read, by engine/model_files.py, torch-free: import those names from there)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from batchinfer.engine.model_files import safetensors_files

if TYPE_CHECKING:
    from batchinfer.engine.models.llama import LlamaForCausalLM

# Which slice of a fused module a checkpoint tensor fills (packed_modules_mapping): 'q'/'k'/'v', 0/1.
ShardId = str | int

# Checkpoint tensors that are buffers recomputed by the model, never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The transformers tokenizer of a resolved model dir (chat template included)."""
    # Any, honestly: a transformers tokenizer, whose typed overloads (apply_chat_template's union result,
    # its fixed keywords) do not take the callers' chat_template_kwargs; they use it as transformers says.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def load_weights(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Fill model's parameters from the safetensors files of path, mapping HF names to fused modules.

    A missing lm_head.weight ties the head to the embedding. Every parameter must be loaded exactly once;
    checkpoint tensors the model has no place for are an error (a wrong architecture or config).
    """
    from safetensors import safe_open

    from batchinfer.engine.parallel.distributed import tp_world_size

    path = Path(path)
    params = dict(model.named_parameters())  # a tied head is not listed separately
    packed: dict[str, tuple[str, ShardId]] = getattr(model, "packed_modules_mapping", {})
    expected: set[tuple[str, ShardId | None]] = set()
    for name in params:
        fused = [(key, shard) for key, (module, shard) in packed.items() if f".{module}." in name]
        if fused:
            expected.update((name, shard) for _, shard in fused)
        else:
            expected.add((name, None))
    tied = bool(getattr(model, "tie_word_embeddings", False))
    elsewhere = getattr(model, "skips_checkpoint_tensor", None)  # a pipeline stage: other stages' tensors
    split = tp_world_size() > 1
    loaded: set[tuple[str, ShardId | None]] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as checkpoint:
            for ckpt_name in checkpoint.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                if ckpt_name.endswith(_IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
                    continue
                if elsewhere is not None and elsewhere(ckpt_name):
                    continue
                name, shard = ckpt_name, None
                for key, (module, shard_id) in packed.items():
                    if f".{key}." in ckpt_name:
                        name, shard = ckpt_name.replace(f".{key}.", f".{module}."), shard_id
                        break
                param = params.get(name)
                if param is None:
                    raise ValueError(
                        f"{file.name}: tensor {ckpt_name!r} has no place in {type(model).__name__}; "
                        "the checkpoint does not match config.json"
                    )
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    _default_weight_loader(param, checkpoint.get_tensor(ckpt_name))
                else:
                    # Under tensor parallelism the layer reads only its rank's part of a lazy slice.
                    tensor = checkpoint.get_slice(ckpt_name) if split else checkpoint.get_tensor(ckpt_name)
                    if shard is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard)
                loaded.add((name, shard))
    missing = expected - loaded
    head = ("lm_head.weight", None)
    if head in missing and hasattr(model, "lm_head") and hasattr(model, "model"):
        hf_model = cast("LlamaForCausalLM", model)  # an architecture of models/ (lm_head, embed_tokens)
        hf_model.lm_head.tie_to(hf_model.model.embed_tokens)  # checkpoint without a head: tied embeddings
        missing.discard(head)
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise ValueError(f"checkpoint {path} lacks {len(names)} tensors the model needs, e.g. {names[:5]}")
