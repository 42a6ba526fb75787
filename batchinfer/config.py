"""Every knob of batchinfer in one place: environment variables `BATCHINFER_*`, an optional TOML file, defaults.

Precedence, highest first: explicit keyword arguments, environment variables, the TOML file named by
`BATCHINFER_CONFIG` (default `<data_dir>/config.toml` when it exists), then the defaults below.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import platformdirs
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_DATA_DIR = Path(platformdirs.user_data_dir("batchinfer", appauthor=False))


def _config_file() -> Path:
    explicit = os.environ.get("BATCHINFER_CONFIG")
    if explicit:
        return Path(explicit)
    data_dir = Path(os.environ.get("BATCHINFER_DATA_DIR", DEFAULT_DATA_DIR))
    return data_dir / "config.toml"


class Settings(BaseSettings):
    """Effective settings of one batchinfer process."""

    model_config = SettingsConfigDict(env_prefix="BATCHINFER_", extra="ignore", validate_default=True)

    # Where things live.
    data_dir: Path = Field(DEFAULT_DATA_DIR, description="Root for the SQLite file, uploads and caches.")
    database_url: str = Field("", description="SQLAlchemy URL; empty means an SQLite file in data_dir.")
    broker_url: str | None = Field(None, description="Celery broker (redis://...); unset means local mode.")
    server: str | None = Field(None, description="A batchinfer API server the CLI talks to instead of the DB.")
    api_key: SecretStr | None = Field(None, description="API key the CLI sends to `server`.")

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
    write_batch_size: int = Field(32, ge=1, description="Worker flushes results every N outputs ...")
    write_interval_ms: int = Field(500, ge=1, description="... or every T milliseconds.")

    # Engine knobs (the worker's defaults; see batchinfer.engine.config.EngineConfig).
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(4096, ge=16)
    max_model_len: int | None = None
    block_size: int = Field(16, ge=1)
    kv_cache_memory_bytes: int = Field(1 << 30, ge=1 << 20)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = Field(1, ge=1)

    # API server.
    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=1, le=65535)
    auth_disabled: bool = Field(False, description="Only honoured when api_host is a loopback address.")

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
        """Add the optional TOML file below the environment."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file()
        if path.is_file():
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
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

    def engine_kwargs(self) -> dict[str, Any]:
        """The EngineConfig keyword arguments these settings imply."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": self.enable_prefix_caching,
            "tensor_parallel_size": self.tensor_parallel_size,
        }

    def public_dict(self) -> dict[str, Any]:
        """Settings as plain values with secrets and URL passwords masked."""
        out: dict[str, Any] = {}
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
        out["config_file"] = str(_config_file())
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


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (cached; call get_settings.cache_clear() after changing the environment)."""
    return Settings()
