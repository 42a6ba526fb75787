"""A model's identity: what decides outputs besides the request (files, adapter, dtype, quantization)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from batchinfer import __version__
from batchinfer.engine.numerics import ENGINE_NUMERICS_VERSION
from batchinfer.wire.result_row import AdapterInfo, Provenance, ResultSource

if TYPE_CHECKING:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.lora.request import LoRARequest

logger = logging.getLogger("batchinfer.workers")

ENGINE_NAME = "batchinfer"
FINGERPRINT_CHUNK = 1 << 20


def fingerprint_dir(path: Path, *, cache_dir: Path | None = None) -> str:
    """sha256 over every file of a model (or adapter) directory, names and bytes; cached on disk (keyed
    by the directory and each file's size and mtime), so a model is read once, not at every start."""
    path = path.resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    manifest = [[str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    cache_file = None
    if cache_dir is not None:
        cache_file = cache_dir / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
        try:
            cached = orjson.loads(cache_file.read_bytes())
            if cached.get("manifest") == manifest:
                return str(cached["fingerprint"])
        except (OSError, ValueError):
            pass
    digest = hashlib.sha256()
    for file, (name, size, _) in zip(files, manifest, strict=True):
        digest.update(f"{name}\0{size}\0".encode())
        with file.open("rb") as stream:
            while chunk := stream.read(FINGERPRINT_CHUNK):
                digest.update(chunk)
    fingerprint = digest.hexdigest()
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            record = {"path": str(path), "manifest": manifest, "fingerprint": fingerprint}
            tmp.write_bytes(orjson.dumps(record))
            tmp.replace(cache_file)
        except OSError:  # a read-only cache dir costs a re-hash next start, nothing else
            logger.debug("could not cache the fingerprint of %s", path, exc_info=True)
    return fingerprint


@dataclass(frozen=True)
class ModelIdentity:
    """What decides outputs besides the request: the model's files, adapter, dtype, quantization."""

    model: str  # the served name results carry
    model_fingerprint: str
    dtype: str
    quantization: str | None
    adapter: str | None = None
    adapter_fingerprint: str | None = None
    # the resolved KV cache (EngineConfig.resolved_kv_cache_dtype: u8 under bfloat16 or int8 weights on
    # CPU): a quantized cache changes outputs as the weights' dtype does
    kv_cache_dtype: str = "auto"
    # float32 GEMMs (EngineConfig.resolved_float32_matmul_precision): "highest" (IEEE), "auto" (bf16x3 for
    # embeddings, which are never cached; generation IEEE) or "high" (bf16x3 for all: keyed, outputs move)
    float32_matmul_precision: str = "highest"

    def key_fields(self) -> dict[str, object]:
        """Everything of the identity the cache key covers (with the engine's numerics version)."""
        fields: dict[str, object] = {
            "numerics": ENGINE_NUMERICS_VERSION, "model": self.model, "fingerprint": self.model_fingerprint,
            "adapter": self.adapter, "adapter_fingerprint": self.adapter_fingerprint, "dtype": self.dtype,
            "quantization": self.quantization}
        if self._quantized_kv_cache():
            fields["kv_cache_dtype"] = self.kv_cache_dtype
        if self.float32_matmul_precision == "high":  # "auto" computes cacheable results as "highest" does
            fields["float32_matmul_precision"] = self.float32_matmul_precision
        return fields

    def provenance(self, *, seed: int | None, source: ResultSource, computed_in: int) -> Provenance:
        """An output line's `provenance` object."""
        adapter = (None if self.adapter is None
                   else AdapterInfo(name=self.adapter, fingerprint=self.adapter_fingerprint))
        provenance: Provenance = {
            "engine": {"name": ENGINE_NAME, "version": __version__}, "model": self.model,
            "model_fingerprint": self.model_fingerprint, "adapter": adapter, "dtype": self.dtype,
            "quantization": self.quantization, "seed": seed, "result_cache": source,
            "computed_in": f"batch_{computed_in}"}
        if self._quantized_kv_cache():  # the estimate's forecast reads it back (from_provenance)
            provenance["kv_cache_dtype"] = self.kv_cache_dtype
        if self.float32_matmul_precision != "highest":  # named only then, as kv_cache_dtype
            provenance["float32_matmul_precision"] = self.float32_matmul_precision
        return provenance

    @classmethod
    def from_provenance(cls, provenance: Provenance) -> ModelIdentity:
        """The identity a `provenance` object records (the inverse of provenance())."""
        adapter = provenance.get("adapter")
        return cls(provenance["model"], provenance["model_fingerprint"], provenance["dtype"],
                   provenance.get("quantization"), adapter["name"] if adapter else None,
                   adapter.get("fingerprint") if adapter else None, provenance.get("kv_cache_dtype", "auto"),
                   provenance.get("float32_matmul_precision", "highest"))

    def _quantized_kv_cache(self) -> bool:
        # named only then: the keys and provenance of results computed before it existed stay the same
        return self.kv_cache_dtype != "auto"


def fingerprint_cache_dir() -> Path:
    """Beside the converted-model cache: $BATCHINFER_CACHE_DIR/fingerprints."""
    from batchinfer.engine.model_files import cache_dir

    return cache_dir() / "fingerprints"


def model_identity(config: EngineConfig, *, served_model: str, adapter: tuple[str, str] | None = None
                   ) -> ModelIdentity:
    """The identity of `config`'s model (fingerprinted once per process and cached on disk)."""
    from batchinfer.engine.model_files import resolve_model_path  # torch-free: hits load no engine

    cache = fingerprint_cache_dir()
    dtype = config.resolved_dtype_name()
    fingerprint = fingerprint_dir(resolve_model_path(config.model), cache_dir=cache)
    name, adapter_fp = None, None
    if adapter is not None:
        name, adapter_fp = adapter[0], fingerprint_dir(Path(adapter[1]), cache_dir=cache)
    return ModelIdentity(served_model, fingerprint, dtype, config.quantization, name, adapter_fp,
                         config.resolved_kv_cache_dtype(), config.resolved_float32_matmul_precision())


def runner_identity(config: EngineConfig, served: str, *, model: str,
                    adapters: Mapping[str, LoRARequest]) -> ModelIdentity:
    """The identity of a runner's shard served as `served`: the model's, or one of its LoRA adapters'."""
    adapter = (served, adapters[served].lora_path) if served in adapters else None
    return model_identity(config, served_model=served if adapter else model, adapter=adapter)
