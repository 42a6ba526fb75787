"""The engine's public face imports no torch (ARCHITECTURE.md, section 1): api/, cli/ and store/ import these
modules at module level, so a submit, a REST call or `batchinfer --help` must not pay for torch."""

from __future__ import annotations

import subprocess
import sys

PUBLIC_FACE = (
    "batchinfer.engine.config",
    "batchinfer.engine.speculative_config",
    "batchinfer.engine.sampling_params",
    "batchinfer.engine.errors",
    "batchinfer.engine.metrics",
    "batchinfer.engine.stat_logger",
    "batchinfer.engine.outputs",
    "batchinfer.engine.numerics",
    "batchinfer.engine.model_files",
    "batchinfer.engine.native.threads",
    "batchinfer.engine.layers.quantization",
)
TOP_ROOMS = ("batchinfer.cli", "batchinfer.api.app", "batchinfer.store.jobs")


def _imports_torch(module: str) -> list[str]:
    code = (f"import sys, {module}; "
            "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_public_face_imports_neither_torch_nor_transformers() -> None:
    """Each public-face module, imported alone in a fresh interpreter, leaves torch and transformers out."""
    loaded = {module: _imports_torch(module) for module in PUBLIC_FACE}
    assert {module: heavy for module, heavy in loaded.items() if heavy} == {}


def test_cli_api_and_store_import_no_torch() -> None:
    """The rooms that import the public face stay torch-free at import too (a mutation that imports an
    engine internal at module level fails here)."""
    loaded = {module: _imports_torch(module) for module in TOP_ROOMS}
    assert {module: heavy for module, heavy in loaded.items() if heavy} == {}
