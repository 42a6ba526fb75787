"""Where a setting's value comes from: the `BATCHINFER_*` names, the optional TOML file, and which of
environment, file or default supplied each value.

Settings (batchinfer.config) reads its TOML source through `read_config_file` and refuses unknown names
through `check_names`; a mistake is a one-line `ConfigError` naming the closest valid setting.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterable
from pathlib import Path

import platformdirs
from pydantic_settings import BaseSettings

from batchinfer.engine.native.threads import CHOSEN_MARKER

DEFAULT_DATA_DIR = Path(platformdirs.user_data_dir("batchinfer", appauthor=False))

ENV_PREFIX = "BATCHINFER_"
# BATCHINFER_* variables that are not settings (read before the settings exist, or by one module).
OTHER_ENV_VARS = frozenset({
    "BATCHINFER_CONFIG",         # the TOML file (this module)
    "BATCHINFER_CACHE_DIR",      # converted models (batchinfer.engine.model_files)
    "BATCHINFER_CPU_ATTENTION",  # "sdpa": no native CPU extension (attention, fused ops, panel GEMM)
    "BATCHINFER_CPU_LINEAR",     # auto / onednn / panel / aten: the CPU GEMM (engine.layers.weight_packing)
    "BATCHINFER_CPU_INT8_GEMM",  # auto / fbgemm / onednn: int8's GEMM (engine.layers.weight_packing)
    "BATCHINFER_CPU_FUSED",      # "0": no fused CPU rotary / SiLU-and-mul (engine.layers.cpu_attention)
    "BATCHINFER_KERNEL_DIR",     # where native CPU kernels are built and found (engine.native.build)
    "BATCHINFER_CPU_NATIVE_STEP",  # "0": the Python layer loop, not the native step (engine.worker)
    CHOSEN_MARKER,               # the OpenMP variables chosen, for child processes (engine.native.threads)
})
TEST_ENV_PREFIX = "BATCHINFER_TEST_"  # the test suite's own servers (tests/conftest.py)


class ConfigError(ValueError):
    """A setting is unknown or invalid, or the config file is missing or unreadable: one line says which."""


def config_file_path() -> Path:
    """The TOML file: BATCHINFER_CONFIG, else config.toml in the data directory (which may not exist)."""
    explicit = os.environ.get("BATCHINFER_CONFIG")
    if explicit:
        return Path(explicit)
    data_dir = Path(os.environ.get("BATCHINFER_DATA_DIR", DEFAULT_DATA_DIR))
    return data_dir / "config.toml"


def _closest(name: str, valid: list[str]) -> str:
    """' (did you mean X?)' for the valid name closest to `name`, or '' when none is close."""
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def read_config_file() -> tuple[Path, dict[str, object]] | None:
    """The TOML file's path and table, None when the default file does not exist."""
    path = config_file_path()
    if not path.is_file():
        if os.environ.get("BATCHINFER_CONFIG"):
            raise ConfigError(f"BATCHINFER_CONFIG={path}: no such file (unset it to use the defaults)")
        return None
    try:
        with path.open("rb") as fh:
            return path, tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def check_names(settings_cls: type[BaseSettings], table: dict[str, object] | None,
                path: Path | None) -> None:
    """Refuse an unknown TOML key or BATCHINFER_* variable, naming the closest valid one."""
    fields = sorted(settings_cls.model_fields)
    for key in table or {}:
        if key not in settings_cls.model_fields:
            raise ConfigError(f"config file {path}: unknown setting {key!r}{_closest(key, fields)}")
    env_names = sorted({ENV_PREFIX + name.upper() for name in fields} | OTHER_ENV_VARS)
    for variable in sorted(os.environ):
        upper = variable.upper()
        if not upper.startswith(ENV_PREFIX) or upper.startswith(TEST_ENV_PREFIX) or upper in env_names:
            continue
        raise ConfigError(f"unknown environment variable {variable}{_closest(upper, env_names)}; "
                          f"settings are {ENV_PREFIX}<NAME> (see `batchinfer config show`)")


def _env_variable(name: str) -> str | None:
    """The environment variable that sets `name`, matched case-insensitively as pydantic-settings does."""
    wanted = ENV_PREFIX + name.upper()
    return next((variable for variable in os.environ if variable.upper() == wanted), None)


def sources_of(names: Iterable[str]) -> dict[str, str]:
    """Where each named setting's value comes from: 'env BATCHINFER_<NAME>', 'file PATH' or 'default'."""
    loaded = read_config_file()
    path, table = loaded if loaded else (None, {})
    out: dict[str, str] = {}
    for name in names:
        variable = _env_variable(name)
        out[name] = f"env {variable}" if variable else f"file {path}" if name in table else "default"
    out["config_file"] = "env BATCHINFER_CONFIG" if os.environ.get("BATCHINFER_CONFIG") else "default"
    return out
