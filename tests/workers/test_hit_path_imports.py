"""A `batchinfer run` served wholly from the result cache imports neither torch nor transformers (issue 31).

The night that repeats yesterday's file pays only for what changed: the hit path (the model checked from
its config.json, its fingerprint, its dtype resolved by name, the keys looked up) must not pay the ~4 s
import of torch + transformers that only a miss needs. Run in a fresh process each, as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
HEAVY_MODULES = ("torch", "transformers")
# Runs the CLI as `python -m batchinfer` does, then reports which heavy modules this process imported.
_REPORTING_CLI = (
    "import atexit, json, sys\n"
    f"heavy = {HEAVY_MODULES!r}\n"
    "atexit.register(lambda: print('IMPORTED', json.dumps([m for m in heavy if m in sys.modules]), "
    "file=sys.stderr))\n"
    "from batchinfer.cli import main\n"
    "main(sys.argv[1:], prog_name='batchinfer')\n"
)


def _write_lines(path: Path) -> None:
    """Deterministic lines: greedy chat, seeded sampled chat, a greedy completion."""
    bodies = [
        {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0},
        {"messages": [{"role": "user", "content": "a seeded one"}], "max_tokens": 4, "temperature": 0.8,
         "seed": 7},
        {"prompt": "once upon a time", "max_tokens": 4, "temperature": 0},
    ]
    urls = ["/v1/chat/completions", "/v1/chat/completions", "/v1/completions"]
    path.write_bytes(b"".join(
        orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}) + b"\n"
        for i, (url, body) in enumerate(zip(urls, bodies, strict=True))))


def _run(tmp_path: Path, model: Path, output: Path) -> tuple[list[str], list[dict]]:
    """One `batchinfer run` of in.jsonl in a fresh process: (heavy modules it imported, output lines)."""
    env = {**os.environ, "BATCHINFER_DATA_DIR": str(tmp_path / "data"),
           "BATCHINFER_DEFAULT_MODEL": str(model), "BATCHINFER_DEVICE": "cpu",
           "BATCHINFER_KV_CACHE_MEMORY_BYTES": str(16 << 20),
           "BATCHINFER_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _REPORTING_CLI, "run", str(tmp_path / "in.jsonl"), "-o",
                           str(output), "--json"], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = [line for line in done.stderr.splitlines() if line.startswith("IMPORTED ")]
    assert report, done.stderr[-3000:]
    lines = [orjson.loads(line) for line in output.read_bytes().splitlines()]
    return orjson.loads(report[-1].removeprefix("IMPORTED ")), lines


def test_a_job_of_hits_imports_neither_torch_nor_transformers(tiny_qwen2: Path, tmp_path: Path) -> None:
    _write_lines(tmp_path / "in.jsonl")
    imported, first = _run(tmp_path, tiny_qwen2, tmp_path / "out1.jsonl")
    assert set(imported) == set(HEAVY_MODULES)  # the misses loaded the engine: the check can see imports
    assert [line["provenance"]["result_cache"] for line in first] == ["miss"] * 3

    imported, second = _run(tmp_path, tiny_qwen2, tmp_path / "out2.jsonl")
    assert imported == []
    assert [line["provenance"]["result_cache"] for line in second] == ["hit"] * 3
    assert [line["response"]["body"]["choices"] for line in second] == [
        line["response"]["body"]["choices"] for line in first]
    # the identity keyed without torch is the one the engine run recorded
    assert [line["provenance"]["dtype"] for line in second] == [line["provenance"]["dtype"] for line in first]


def test_device_auto_resolves_without_torch_on_a_cpu_build() -> None:
    """Device "auto" (the default) keys a hit (its dtype) without importing torch on a CPU-only torch."""
    from batchinfer.engine.config import torch_is_cpu_only_build

    probe = ("import sys\n"
             "from batchinfer.engine.config import EngineConfig, torch_is_cpu_only_build\n"
             "config = EngineConfig(model='m', device='auto')\n"
             "print(torch_is_cpu_only_build(), config.resolved_device(), config.resolved_dtype_name(), "
             "'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120, check=True)
    cpu_only, device, _, torch_imported = done.stdout.split()
    assert cpu_only == str(torch_is_cpu_only_build())
    import torch

    assert torch_is_cpu_only_build() == (torch.version.cuda is None and torch.version.hip is None)
    if cpu_only == "True":
        assert (device, torch_imported) == ("cpu", "False")
