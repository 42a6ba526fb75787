"""Two builds of the native CPU kernels, A and B, over a whole model's panel GEMMs, step by step in turn.

On a shared host the speed of one build drifts by 10-30% between runs minutes apart, more than most kernel
changes are worth. This runs each build in its own worker process (two builds' extensions cannot share one:
pybind11 registers their classes once per process), both holding SmolLM2-135M's 121 GEMMs' panels
(bench/panel_gemm.py's model_weights: random weights, streamed from memory), and alternates single
steps between them (ABBA order), so both see the same moments of the host; it prints each build's
median step and A / B.

A build is the `.so` that `batchinfer build-kernels` prints the folder of; another commit's build comes from
a worktree of it:

    git worktree add /tmp/old <commit> && PYTHONPATH=/tmp/old .venv/bin/batchinfer build-kernels
    .venv/bin/python bench/kernel_ab.py OLD.so NEW.so --rows 1 4 16 32 96 --steps 25
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO


def serve(extension_path: Path, dtype_name: str) -> None:
    """Worker: pack the model's panels with this build, then time one step per row count read from stdin."""
    from batchinfer.engine.native.threads import configure_openmp_env, usable_cores

    os.environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))
    configure_openmp_env()  # before torch is imported
    import torch

    spec = importlib.util.spec_from_file_location(extension_path.name.split(".")[0], extension_path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{extension_path}: not a loadable extension")
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    from panel_gemm import HIDDEN, INTERMEDIATE, model_weights  # bench/ is this script's sys.path[0]

    packs = [(extension.pack_panels(weight), weight.shape[0], weight.shape[1])
             for weight in model_weights(getattr(torch, dtype_name))]
    print("ready", flush=True)
    for line in sys.stdin:
        rows = int(line)
        inputs = {k: torch.randn(rows, k) for k in (HIDDEN, INTERMEDIATE)}
        start = time.perf_counter()
        for panels, n, k in packs:
            extension.panel_linear(inputs[k], panels, None, n)
        print(time.perf_counter() - start, flush=True)


def step(worker: subprocess.Popen[str], rows: int) -> float:
    """One step of `rows` rows on a worker: its seconds."""
    stdin, stdout = worker.stdin, worker.stdout
    assert stdin is not None and stdout is not None  # opened as pipes
    stdin.write(f"{rows}\n")
    stdin.flush()
    return float(stdout.readline())


def main() -> None:
    """Start a worker per build and print each row count's medians, alternating A and B."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="build A's extension (.so)")
    parser.add_argument("b", type=Path, help="build B's extension (.so)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 96])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=25, help="steps per build and row count")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a worker (internal)
    args = parser.parse_args()
    if args.serve:
        return serve(args.a, args.dtype)
    workers = [subprocess.Popen([sys.executable, __file__, str(path), str(path), "--serve", "--dtype",
                                 args.dtype], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for path in (args.a, args.b)]
    for worker in workers:
        ready: IO[str] | None = worker.stdout
        if ready is None or ready.readline().strip() != "ready":
            raise SystemExit("a worker failed to load its build")
    print(f"{args.dtype}, 121 GEMMs of SmolLM2-135M, {args.steps} steps per build, ABBA order")
    for rows in args.rows:
        times: tuple[list[float], list[float]] = ([], [])
        for index in range(args.steps):
            for which in ((0, 1) if index % 2 == 0 else (1, 0)):
                times[which].append(step(workers[which], rows))
        a_ms, b_ms = (statistics.median(t) * 1e3 for t in times)
        print(f"rows {rows:4d}  A {a_ms:7.1f} ms  B {b_ms:7.1f} ms  A / B {a_ms / b_ms:.2f}x", flush=True)
    for worker in workers:
        if worker.stdin is not None:
            worker.stdin.close()
        worker.wait()


if __name__ == "__main__":
    main()
