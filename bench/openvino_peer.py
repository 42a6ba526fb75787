"""OpenVINO GenAI, the peer of bench/engine_throughput.py: export once, then run one workload in a subprocess.

The peer lives in its own venv (`make bench-peers` builds .venv-peers), never the project's, so this file
has two halves:
  - the parent side (imported by engine_throughput.py under the project venv, no openvino import):
    `ensure_export` runs optimum-cli of the peers venv once per weight format and caches the IR under
    the batchinfer cache dir; `run_peer` hands a token-id workload to a child as JSON and reads its figures;
  - the child side (`python bench/openvino_peer.py run ...` under the peers venv): a
    ContinuousBatchingPipeline with prefix caching and dynamic_split_fuse on INFERENCE_NUM_THREADS = cores,
    greedy, each request with its own max_new_tokens, stopping at the model's EOS ids.

Rows (PEER_ROWS): fp32 = fp32 IR with INFERENCE_PRECISION_HINT=f32 and KV_CACHE_PRECISION=f32; bf16 =
fp32 IR with the CPU plugin's defaults (bf16 compute on avx512_bf16 / AMX, f32 on an AVX2-only CPU; u8 KV
cache); int8 = int8-weight IR with the same defaults. The child reports the defaults it ran with.

    .venv-peers/bin/python bench/openvino_peer.py run --ir DIR --workload w.json --out r.json --precision fp32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

# precision row -> (optimum-cli --weight-format of the IR it runs, CPU plugin properties beyond the threads)
PEER_ROWS: dict[str, tuple[str, dict[str, str]]] = {
    "fp32": ("fp32", {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}),
    "bf16": ("fp32", {}),  # the CPU defaults: bf16 compute where the CPU has it, u8 KV cache
    "int8": ("int8", {}),
}
PEER_NAME = "OpenVINO GenAI ContinuousBatchingPipeline"
KV_CACHE_GB = 1  # the same budget as EngineConfig.kv_cache_memory_bytes' default (1 GiB)


# --- parent side (project venv) -------------------------------------------------------------------------


def ensure_export(peers_python: Path, model_dir: Path, weight_format: str, cache_root: Path) -> Path:
    """The OpenVINO IR of model_dir at weight_format, exported once with the peers venv's optimum-cli."""
    target = cache_root / "openvino" / f"{model_dir.name}-{weight_format}"
    if (target / "openvino_model.xml").is_file() and (target / "openvino_tokenizer.xml").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Exported beside the target and renamed into place: the cached dir exists only when complete.
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        cli = Path(peers_python).parent / "optimum-cli"
        done = subprocess.run(
            [str(cli), "export", "openvino", "--model", str(model_dir), "--task", "text-generation-with-past",
             "--weight-format", weight_format, str(scratch)],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"optimum-cli export failed ({done.returncode}): {done.stderr[-2000:]}")
        shutil.rmtree(target, ignore_errors=True)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def run_peer(peers_python: Path, ir_dir: Path, precision: str, workload: dict, threads: int) -> dict:
    """Run one precision row of the peer in a child process on the workload; its JSON figures."""
    with tempfile.TemporaryDirectory(prefix="openvino-peer-") as scratch:
        workload_file, out_file = Path(scratch) / "workload.json", Path(scratch) / "result.json"
        workload_file.write_text(json.dumps(workload))
        subprocess.run(
            [str(peers_python), __file__, "run", "--ir", str(ir_dir), "--precision", precision,
             "--threads", str(threads), "--workload", str(workload_file), "--out", str(out_file)],
            check=True,
        )
        return json.loads(out_file.read_text())


# --- child side (peers venv) ----------------------------------------------------------------------------


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_defaults(core: object) -> str:
    """The CPU plugin's default compute and KV cache precisions here ("f32 compute, u8 KV cache")."""
    def name(key: str) -> str:
        value = str(core.get_property("CPU", key))  # type: ignore[attr-defined]  # openvino.Core
        return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8_t": "u8", "int8_t": "i8"}.get(
            value.split("'")[1] if "'" in value else value, value)
    return f"CPU defaults: {name('INFERENCE_PRECISION_HINT')} compute, {name('KV_CACHE_PRECISION')} KV cache"


def run_workload(ir_dir: str, precision: str, threads: int, workload: dict) -> dict:
    """Generate the workload with a ContinuousBatchingPipeline; outputs, wall and CPU seconds."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    scheduler = ov_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = True
    scheduler.dynamic_split_fuse = True
    scheduler.cache_size = KV_CACHE_GB
    properties: dict[str, object] = {"INFERENCE_NUM_THREADS": threads, **PEER_ROWS[precision][1]}
    start = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(ir_dir, scheduler, "CPU", properties)
    load_seconds = time.perf_counter() - start
    eos = list(workload["eos_token_ids"])
    configs = []
    for budget in workload["budgets"]:
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = budget
        config.do_sample = False
        config.eos_token_id = eos[0]
        config.stop_token_ids = set(eos)
        config.ignore_eos = bool(workload.get("ignore_eos", False))
        configs.append(config)
    inputs = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids in workload["prompts"]]
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    results = pipe.generate(inputs, configs)
    seconds, cpu_seconds = time.perf_counter() - start, _cpu_seconds() - cpu_start
    outputs = [[int(t) for t in result.m_generation_ids[0]] for result in results]
    return {
        "outputs": outputs, "seconds": seconds, "cpu_seconds": cpu_seconds, "load_seconds": load_seconds,
        "properties": {k: str(v) for k, v in properties.items()}, "openvino": ov.__version__,
        "defaults": cpu_defaults(ov.Core()),
        "openvino_genai": ov_genai.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one precision row on a workload (peers venv)")
    run.add_argument("--ir", required=True, help="the exported OpenVINO IR directory")
    run.add_argument("--precision", choices=sorted(PEER_ROWS), required=True)
    run.add_argument("--threads", type=int, default=os.cpu_count())
    run.add_argument("--workload", required=True, help="JSON: prompts (token ids), budgets, eos_token_ids")
    run.add_argument("--out", required=True, help="where the JSON figures go")
    args = parser.parse_args()
    workload = json.loads(Path(args.workload).read_text())
    result = run_workload(args.ir, args.precision, args.threads, workload)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
