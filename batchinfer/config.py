"""Every knob of batchinfer in one place: environment variables `BATCHINFER_*`, an optional TOML file,
defaults.

Precedence, highest first: explicit keyword arguments, environment variables, the TOML file named by
`BATCHINFER_CONFIG` (default `<data_dir>/config.toml` when it exists), then the defaults below.

Mistakes are one-line `ConfigError`s rather than tracebacks: an unknown TOML key or `BATCHINFER_*`
variable names the closest valid setting, a `BATCHINFER_CONFIG` naming no file is an error, and an
invalid value names the setting and where it came from (`setting_sources`). Reading the TOML file, the
`BATCHINFER_*` names that are not settings, and telling which source gave a value: config_sources.py.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from batchinfer.config_sources import (
    DEFAULT_DATA_DIR,
    ConfigError,
    check_names,
    config_file_path,
    read_config_file,
    sources_of,
)
from batchinfer.engine.config import FLOAT32_MATMUL_PRECISIONS
from batchinfer.engine.kv_cache_dtypes import canonical_kv_cache_dtype
from batchinfer.engine.layers.quantization import QUANTIZATIONS
from batchinfer.engine.speculative_config import parse_speculative_config
from batchinfer.engine_kwargs import EngineKwargs
from batchinfer.wire.json_types import JSONObject

# Limits on by default that 0 or one of OFF_WORDS turns off (README "Security").
DISABLEABLE_LIMITS = ("max_owner_stored_bytes", "max_owner_active_jobs", "max_owner_pending_requests",
                      "finished_job_retention_seconds")
OFF_WORDS = frozenset({"", "0", "0.0", "none", "off", "null"})


def setting_sources() -> dict[str, str]:
    """Where each setting's value comes from: 'env BATCHINFER_<NAME>', 'file PATH' or 'default'."""
    return sources_of(Settings.model_fields)


class Settings(BaseSettings):
    """Effective settings of one batchinfer process."""

    model_config = SettingsConfigDict(env_prefix="BATCHINFER_", extra="ignore", validate_default=True)

    # Where things live.
    data_dir: Path = Field(DEFAULT_DATA_DIR, description="Root for the SQLite file, uploads and caches.")
    database_url: str = Field("", description="SQLAlchemy URL; empty means an SQLite file in data_dir.")
    broker_url: str | None = Field(None, description="Celery broker (redis://...); unset means local mode.")
    server: str | None = Field(None,
                               description="A batchinfer API server the CLI talks to instead of the DB.")
    api_key: SecretStr | None = Field(None, description="API key the CLI sends to `server`.")
    server_retry_seconds: float = Field(
        120.0, ge=0, description="How long `submit --wait` against `server` retries it while it restarts.")

    # Jobs.
    default_model: str = "smollm2-135m-instruct"
    shard_size: int = Field(256, ge=1, description="Requests per shard.")
    max_line_bytes: int = Field(1 << 20, ge=64, description="Longest accepted input line.")
    max_requests_per_job: int = Field(5_000_000, ge=1)
    max_metadata_bytes: int = Field(16 * 1024, ge=0)
    max_upload_bytes: int = Field(2 << 30, ge=1, description="Largest accepted /v1/files upload.")
    completion_window: str = "24h"
    lease_seconds: float = Field(120.0, gt=0, description="Shard lease; workers heartbeat well within it.")
    max_attempts: int = Field(3, ge=1, description="Claims of a shard before it fails with worker_lost.")
    # Periodic duties (workers.duties; README "Reliability" says who runs which in each deployment shape).
    rescue_interval_seconds: float | None = Field(
        None, gt=0, description="How often expired leases are rescued; unset: a quarter of lease_seconds.")
    expiry_sweep_seconds: float = Field(30.0, gt=0, description="How often jobs past their window expire.")
    schedule_tick_seconds: float = Field(15.0, gt=0, description="How often due schedule slots start.")
    ingest_lease_seconds: float = Field(
        60.0, gt=0, description="A submit whose ingest is silent this long is failed by the rescuer.")
    write_batch_size: int = Field(32, ge=1, description="Worker flushes results every N outputs ...")
    write_interval_ms: int = Field(500, ge=1, description="... or every T milliseconds.")
    # Result cache across jobs (store/result_cache.py; README "Result cache").
    result_cache: Literal["use", "refresh", "off"] = Field(
        "use", description="A job's default: use cached results of deterministic requests, refresh "
        "them, or off.")
    result_cache_max_bytes: int = Field(
        4 << 30, ge=0, description="Bytes of cached result bodies kept (least recently used evicted); "
        "0: none.")

    # Tenants and resource bounds (README "Security": what each protects, which settings loosen it).
    prefix_cache_scope: Literal["owner", "global"] = Field(
        "owner", description="owner: each owner's requests hit only its own cached prefixes; global: shared.")
    max_request_kv_tokens: int | None = Field(
        None, ge=1, description="Cap on n x (prompt + max_tokens) of one request; unset: what "
        "kv_cache_memory_bytes holds of the job's model when its config is local, else 262,144.")
    max_request_logprobs: int = Field(
        1 << 18, ge=1, description="Cap on n x max_tokens x (1 + top_logprobs) of a request with logprobs.")
    max_stop_sequences: int = Field(16, ge=1, description="Stop strings one request may give (OpenAI: 4).")
    max_bad_words: int = Field(1024, ge=1, description="bad_words one request may give.")
    max_allowed_token_ids: int = Field(4096, ge=1, description="allowed_token_ids one request may give.")
    max_logit_bias: int = Field(300, ge=1, description="logit_bias entries of one request (OpenAI: 300).")
    # Structured output (engine/sampling/: grammars.py GrammarBudget, structured.py GrammarBackend).
    max_constraint_depth: int = Field(
        64, ge=1, description="Nesting levels of a JSON Schema constraint (brackets of a regex / grammar).")
    max_constraint_bytes: int = Field(1 << 20, ge=64, description="Size of one output constraint's text.")
    grammar_compile_timeout_seconds: float = Field(
        30.0, gt=0, description="Time one constraint may take to convert (ingest) or compile (worker).")
    grammar_compile_workers: int = Field(2, ge=1, description="Worker threads compiling grammars, shared "
                                         "fairly between owners.")
    compiled_grammar_cache_bytes: int = Field(
        512 << 20, ge=1 << 20, description="Memory of compiled grammars a worker keeps for reuse.")
    ingest_chunk_bytes: int = Field(8 << 20, ge=1 << 16, description="Input bytes per ingest commit.")
    max_form_fields: int = Field(16, ge=1, description="Form fields of one multipart upload.")
    # On by default (a shared deployment is safe as installed); 0 or "none" turns each one off.
    max_owner_stored_bytes: int | None = Field(
        50 << 30, ge=1, description="Bytes of uploaded files one owner may keep; 0 or none: no limit.")
    max_owner_active_jobs: int | None = Field(
        100, ge=1, description="Jobs not yet finished one owner may have; 0 or none: no limit.")
    max_owner_pending_requests: int | None = Field(
        20_000_000, ge=1, description="Requests one owner may have waiting to run; 0 or none: no limit.")
    max_owner_concurrent_uploads: int = Field(
        4, ge=1, description="Uploads one owner may stream at once to one API process (more: 429).")
    allowed_models: list[str] = Field(
        default_factory=list, description="Models a batch may name besides default_model and the models "
        "live workers serve; empty: those only (any name while no worker is live).")
    finished_job_retention_seconds: float | None = Field(
        30 * 86400.0, gt=0, description="Finished jobs older than this are purged; 0 or none: kept forever.")
    purge_interval_seconds: float = Field(3600.0, gt=0, description="How often the purge step runs.")
    schedule_roots: list[Path] = Field(
        default_factory=list, description="Where schedule inputs and outputs may be; empty: data_dir.")
    webhook_allow_private: bool = Field(
        False, description="Allow webhooks to loopback, link-local and private addresses.")
    webhook_timeout_seconds: float = Field(10.0, gt=0, description="Whole-call limit of one webhook.")
    metrics_token: SecretStr | None = Field(
        None, description="Bearer token /metrics requires; unset: open, with per-model series aggregated.")

    # Engine knobs (the worker's defaults; see batchinfer.engine.config.EngineConfig).
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = Field(
        "auto", description="KV cache element type: auto (u8 under a bfloat16 model or int8 weights on "
                            "CPU, else the model's dtype), or on CPU fp32 (float32 models), bf16, fp8_e4m3, "
                            "int8 or u8 (1 byte: "
                            "1.8-1.9x the tokens in the same kv_cache_memory_bytes).")
    # Literal[...]: the tuple's values, one definition; pydantic reads it, mypy cannot
    float32_matmul_precision: Literal[FLOAT32_MATMUL_PRECISIONS] = Field(  # type: ignore[valid-type]
        "auto", description="float32 models on a CPU with AMX: highest (IEEE float32 GEMMs), high (each "
                            "float32 as two bf16s, three products on AMX tiles: errors ~5e-6 of an output's "
                            "scale, the GEMMs 1.2-1.9x faster from 16 rows), auto (high for embeddings, "
                            "highest for generation).")
    quantization: Literal[QUANTIZATIONS] | None = Field(  # type: ignore[valid-type]
        None, description="int8: per-channel int8 weights, dynamic int8 GEMMs (CPU); gguf: a .gguf model's "
                          "own Q4_0 / Q4_1 / Q8_0 blocks (CPU); unset: the dtype's.")
    adaptive_threads: bool = Field(
        True, description="CPU: run one thread fewer per core other work keeps busy, back up when it leaves.")
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(4096, ge=16)
    max_model_len: int | None = None
    block_size: int = Field(16, ge=1)
    kv_cache_memory_bytes: int = Field(1 << 30, ge=1 << 20)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages of layers (one per node, with Ray).")
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        "mp", description="How the ranks start: local processes, or Ray actors on a running Ray cluster.")
    speculative_config: JSONObject | None = Field(
        None, description='Speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4} or '
        '{"method": "draft_model", "model": "...", "num_speculative_tokens": 3}; unset: off.')
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters served beside the model, name -> PEFT adapter "
        "directory (--lora-modules NAME=PATH); a line runs under one with body.model = NAME.")
    max_loras: int = Field(4, ge=1, description="LoRA adapters active in one engine step.")
    max_lora_rank: int = Field(16, ge=1, description="The largest LoRA rank an adapter may have.")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters kept loaded (least recently used evicted); unset: max_loras.")

    # Worker metrics: each `batchinfer worker` serves Prometheus metrics on its own port (workers.metrics).
    worker_metrics_port: int | None = Field(None, ge=0, le=65535,
                                            description="Port of the worker's /metrics; 0 or unset: off.")
    worker_metrics_host: str = Field("0.0.0.0", description="Address the worker's metrics port binds.")

    # API server.
    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=1, le=65535)
    auth_disabled: bool = Field(False, description="Only honoured when api_host is a loopback address.")
    api_access_log: bool = Field(
        True, description="One line per request on stderr (time, client, request line, status); false: off.")
    api_shutdown_timeout_seconds: float = Field(
        10.0, gt=0, description="On SIGTERM the API waits this long for requests (uploads) to end, then "
        "cuts them off.")
    staged_upload_max_idle_seconds: float = Field(
        3600.0, gt=0, description="At API start, staged uploads of dead processes, or idle this long, go.")

    @field_validator("speculative_config", mode="after")
    @classmethod
    def _check_speculative_config(cls, value: JSONObject | None) -> JSONObject | None:
        parse_speculative_config(value)  # a ValueError naming speculative_config.<key>
        return value

    @field_validator(*DISABLEABLE_LIMITS, mode="before")
    @classmethod
    def _off_as_none(cls, value: object) -> object:
        """0, "0", "none", "off" or "" turn a limit off (None), from the environment or TOML alike."""
        if isinstance(value, str) and value.strip().lower() in OFF_WORDS:
            return None
        if value == 0 and not isinstance(value, bool):
            return None
        return value

    @field_validator("dtype", mode="after")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        from batchinfer.engine.config import canonical_dtype  # pure Python

        return canonical_dtype(value)  # read here, so `config show` refuses what `run` would

    @field_validator("kv_cache_dtype", mode="after")
    @classmethod
    def _check_kv_cache_dtype(cls, value: str) -> str:
        return canonical_kv_cache_dtype(value)  # refused when read, as `run` and `worker` would refuse it

    @field_validator("device", mode="after")
    @classmethod
    def _check_device(cls, value: str) -> str:
        from batchinfer.engine.config import check_device

        return check_device(value)

    @field_validator("database_url", mode="after")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Add the optional TOML file below the environment, after refusing unknown names."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        loaded = read_config_file()
        check_names(settings_cls, loaded[1] if loaded else None, loaded[0] if loaded else None)
        if loaded:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=loaded[0]))
        return tuple(sources)

    @property
    def effective_database_url(self) -> str:
        """The database URL, defaulting to an SQLite file inside data_dir."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'batchinfer.db'}"

    @property
    def local_mode(self) -> bool:
        """True when no broker is configured: workers poll the database."""
        return not self.broker_url

    @property
    def effective_rescue_interval_s(self) -> float:
        """Seconds between rescue passes: the setting, else a quarter of a lease (an expired lease waits
        at most that long for its rescue)."""
        return self.rescue_interval_seconds or self.lease_seconds / 4

    def engine_kwargs(self) -> EngineKwargs:
        """The EngineConfig keyword arguments these settings imply."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "float32_matmul_precision": self.float32_matmul_precision,
            "quantization": self.quantization,
            "adaptive_threads": self.adaptive_threads,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": self.enable_prefix_caching,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "distributed_executor_backend": self.distributed_executor_backend,
            "speculative_config": parse_speculative_config(self.speculative_config),
            "enable_lora": bool(self.lora_modules),
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
            "grammar_compile_workers": self.grammar_compile_workers,
            "grammar_compile_timeout_s": self.grammar_compile_timeout_seconds,
            "compiled_grammar_cache_bytes": self.compiled_grammar_cache_bytes,
        }

    def public_dict(self) -> dict[str, object]:
        """Settings as plain values with secrets and URL passwords masked."""
        out: dict[str, object] = {}
        for name, value in self.model_dump().items():
            if isinstance(value, SecretStr):
                value = "********" if value.get_secret_value() else ""
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, str) and name.endswith("_url"):
                value = mask_url_password(value)
            out[name] = value
        out["database_url"] = mask_url_password(self.effective_database_url)
        out["local_mode"] = self.local_mode
        out["config_file"] = str(config_file_path())
        return out


def mask_url_password(url: str) -> str:
    """Replace the password of a URL like scheme://user:pass@host with ****."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    if ":" in creds:
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:****@{host}"
    return url


def load_settings(**overrides: Any) -> Settings:  # Any: any setting's value, pydantic checks it
    """Settings from the environment and the config file; a mistake is one ConfigError line."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe_invalid(exc, overrides)) from None


def _describe_invalid(exc: ValidationError, overrides: dict[str, object]) -> str:
    """One line for the first invalid value: the setting, the value, where it came from, what is wrong."""
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else "?"
    source = "argument" if name in overrides else setting_sources().get(name, "default")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    value = error.get("input")
    shown = f" = {value!r}" if isinstance(value, str | int | float | bool) else ""
    message = error["msg"].removeprefix("Value error, ")  # pydantic's prefix on a validator's ValueError
    return f"invalid setting {name}{shown} (from {source}): {message}{more}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (cached; call get_settings.cache_clear() after changing the environment)."""
    return load_settings()
