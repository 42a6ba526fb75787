"""Contention: the engine's tokens per CPU-second quiet vs with one other busy process on the machine.

Issue 21's target: with one other busy process (here a Python busy loop pinned to the last core) the
engine keeps >= 80% of its quiet tokens per CPU-second, whether the busy process was there when the
engine started ("at start") or arrives while it runs ("later": the loop starts after the warm-up). Each
measurement runs in a fresh child process, because OpenMP reads its wait policy once, when torch is
imported:
  - policy "engine": the defaults of batchinfer.engine.native.threads (what the CLI, workers and benches set),
    with the ThreadGovernor re-choosing the thread count while the engine runs;
  - policy "start": the same defaults with the count fixed when the process starts (adaptive_threads off);
  - policy "none": libgomp's own defaults (all cores, spinning waits), the engine as it was before;
  - `--env NAME=VALUE` adds explicit variables to a child (they win over both), for experiments;
  - with --peers-python (the `make bench-peers` venv), OpenVINO GenAI on the same workload, for scale.
The workload is the chat workload (ignore_eos, so every run does the same work) at the engine's dtype.

    .venv/bin/python bench/contention.py
    .venv/bin/python bench/contention.py --peers-python .venv-peers/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from chat_workload import MODEL_ALIAS, build_workload, load_line, process_cpu_seconds
from openvino_peer import PEER_NAME, PEER_ROWS, ensure_export, run_peer

from batchinfer.engine.native.threads import CHOSEN_MARKER

POLICIES = ("none", "start", "engine")
ARRIVALS = ("at start", "later")
TARGET_KEPT = 0.8  # issue 21: keep >= 80% of the quiet tokens per CPU-second


@contextlib.contextmanager
def busy_process(core: int) -> Iterator[int]:
    """A Python busy loop pinned to `core` for the duration of the block; its pid."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(proc.pid, {core})
        time.sleep(0.5)  # let it settle on its core before we measure
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def run_child(args: argparse.Namespace, policy: str, extra_env: dict[str, str], busy: str | None) -> dict:
    """One measurement in a fresh process, with the busy loop `busy` ("at start", "later") or none."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_")) and k != CHOSEN_MARKER}
    env.update(extra_env)
    busy_core = max(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        out, ready, go = Path(tmp, "out.json"), Path(tmp, "ready"), Path(tmp, "go")
        command = [sys.executable, __file__, "--child", policy, "--out", str(out),
                   "--num-prompts", str(args.num_prompts), "--min-tokens", str(args.min_tokens),
                   "--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
        if busy != "later":
            with busy_process(busy_core) if busy else contextlib.nullcontext():
                subprocess.run(command, check=True, env=env)
        else:  # the child warms up, says ready, and measures once the loop runs
            child = subprocess.Popen([*command, "--ready", str(ready), "--go", str(go)], env=env)
            while not ready.exists() and child.poll() is None:
                time.sleep(0.05)
            with busy_process(busy_core):
                go.touch()
                if child.wait() != 0:
                    raise subprocess.CalledProcessError(child.returncode, command)
        return json.loads(out.read_text())


def peer_precision(dtype: str) -> str:
    """The OpenVINO row matching our dtype ("auto" as the engine resolves it on CPU): fp32, or bf16 (its
    default, bf16 compute + u8 KV)."""
    from batchinfer.engine.config import EngineConfig

    resolved = str(EngineConfig(model=MODEL_ALIAS, dtype=dtype, device="cpu").resolved_dtype())
    return "fp32" if resolved == "torch.float32" else "bf16"


def run_openvino(args: argparse.Namespace, busy: str | None) -> dict:
    """The peer on the same workload (all cores, as in engine_throughput.py), in its own venv."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.model_files import cache_dir
    from batchinfer.engine.models.resolved_model import resolve_model

    resolved = resolve_model(EngineConfig(model=MODEL_ALIAS))
    prompts, budgets = build_workload(resolved.tokenizer, args.num_prompts, args.min_tokens, args.max_tokens)
    precision = peer_precision(args.dtype)
    ir_dir = ensure_export(Path(args.peers_python), resolved.path, PEER_ROWS[precision][0], cache_dir())
    workload = {"prompts": prompts, "budgets": budgets, "eos_token_ids": sorted(resolved.eos_token_ids),
                "ignore_eos": True}
    threads = len(os.sched_getaffinity(0))
    with busy_process(max(os.sched_getaffinity(0))) if busy else contextlib.nullcontext():
        figures = run_peer(Path(args.peers_python), ir_dir, precision, workload, threads)
    tokens = sum(map(len, figures["outputs"]))
    return {"tokens": tokens, "seconds": figures["seconds"], "cpu_seconds": figures["cpu_seconds"],
            "threads": threads, "env": figures["properties"]}


def child_main(args: argparse.Namespace) -> None:
    """Measure one run of the engine under the given policy (in this fresh process)."""
    applied = {}
    if args.child != "none":
        from batchinfer.engine.native.threads import configure_openmp_env

        applied = configure_openmp_env()
    import torch

    from batchinfer.engine.llm import LLM
    from batchinfer.engine.sampling_params import SamplingParams

    llm = LLM(MODEL_ALIAS, dtype=args.dtype, device="cpu", adaptive_threads=args.child == "engine")
    prompts, budgets = build_workload(llm.get_tokenizer(), args.num_prompts, args.min_tokens, args.max_tokens)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in budgets]
    llm.generate(prompts[:4], params[:4])  # warm-up: the first step builds kernels and caches
    if args.ready:
        Path(args.ready).touch()
        while not Path(args.go).exists():
            time.sleep(0.05)
        time.sleep(0.5)  # the busy loop settles on its core
    threads_at_start = torch.get_num_threads()
    cpu_start, start = process_cpu_seconds(), time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds, cpu_seconds = time.perf_counter() - start, process_cpu_seconds() - cpu_start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))}
    Path(args.out).write_text(json.dumps({
        "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu_seconds,
        "threads": f"{threads_at_start}->{torch.get_num_threads()}", "applied": applied, "env": env,
    }))


def describe(result: dict) -> str:
    """tok/s, tokens per CPU-second, threads."""
    return (f"{result['tokens'] / result['seconds']:6.1f} tok/s, "
            f"{result['tokens'] / result['cpu_seconds']:6.1f} tok/CPU-s, {result['threads']} threads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", action="append", choices=POLICIES,
                        help="thread policy to measure (repeatable; default: both)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an explicit OpenMP variable for every child (repeatable)")
    # Small on purpose: libgomp's default policy runs ~10x slower contended (issue 21).
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (auto: its CPU default)")
    parser.add_argument("--peers-python", help="python of the peers venv: adds OpenVINO GenAI beside us")
    parser.add_argument("--arrival", action="append", choices=ARRIVALS,
                        help="when the busy loop starts (repeatable; default: both)")
    parser.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    parser.add_argument("--go", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    extra_env = dict(item.split("=", 1) for item in args.env)
    busy_core = max(os.sched_getaffinity(0))
    arrivals = args.arrival or ARRIVALS
    print(f"machine: {os.cpu_count()} cpus; {load_line()}")
    print(f"workload: {args.num_prompts} chat prompts, max_tokens {args.min_tokens}..{args.max_tokens}, "
          f"ignore_eos, dtype {args.dtype}; contended = a Python busy loop pinned to cpu {busy_core}, "
          f"there {' / '.join(arrivals)}" + (f"; explicit env {extra_env}" if extra_env else ""))
    systems = [(f"batchinfer, thread policy {policy}",
                lambda busy, p=policy: run_child(args, p, extra_env, busy), arrivals)
               for policy in args.policy or POLICIES]
    if args.peers_python:  # the peer picks its threads once; the busy loop runs around its whole process
        systems.append((f"{PEER_NAME} [{peer_precision(args.dtype)}]", lambda busy: run_openvino(args, busy),
                        ("at start",)))
    rows = []
    for label, measure, system_arrivals in systems:
        quiet = measure(None)
        print(f"{label} (env {quiet['env']}):")
        print(f"  quiet:              {describe(quiet)}")
        for arrival in system_arrivals:
            contended = measure(arrival)
            kept = per_cpu_second(contended) / per_cpu_second(quiet)
            speed = (contended["tokens"] / contended["seconds"]) / (quiet["tokens"] / quiet["seconds"])
            rows.append((label, arrival, quiet, contended, kept))
            print(f"  contended {arrival:>8}: {describe(contended)}")
            print(f"  kept {kept:.0%} of the quiet tokens per CPU-second (target >= {TARGET_KEPT:.0%}: "
                  f"{'met' if kept >= TARGET_KEPT else 'missed'}), {speed:.0%} of the quiet tok/s")
    print(load_line())
    print()
    print("| system | busy loop | quiet tok/s | quiet tok/CPU-s | contended tok/s | contended tok/CPU-s "
          "| threads | kept |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for label, arrival, quiet, contended, kept in rows:
        print(f"| {label} | {arrival} | {quiet['tokens'] / quiet['seconds']:.1f} "
              f"| {per_cpu_second(quiet):.1f} "
              f"| {contended['tokens'] / contended['seconds']:.1f} | {per_cpu_second(contended):.1f} "
              f"| {quiet['threads']} / {contended['threads']} | {kept:.0%} |")


def per_cpu_second(result: dict) -> float:
    """Tokens per CPU-second of one measurement."""
    return result["tokens"] / result["cpu_seconds"]


if __name__ == "__main__":
    main()
