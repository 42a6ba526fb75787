"""Per-step cost of the native CPU step (issue 34) against the Python layer loop, paired in one process.

For each precision one ModelRunner of SmolLM2-135M-Instruct runs decode steps of B sequences of ~200
cached tokens; the same runner alternates the native step (csrc/decoder_stack.cpp) and the Python layer
loop (runner.native_step = None), --rounds times, and prints ms per step, tok/s, tokens per CPU-second and
the ratio, with the load average (other processes share the machine).

    .venv/bin/python bench/native_step_ab.py --configs float32 bfloat16 float32:int8 --batch-sizes 1 8 32 96
"""

from __future__ import annotations

import argparse
import os
import time

import torch

CONTEXT = 200  # cached tokens of each sequence before the measured decode steps


class Seq:
    """The three Sequence fields the runner reads."""

    def __init__(self, token_ids: list[int], block_table: list[int], num_computed_tokens: int) -> None:
        self.token_ids, self.block_table = token_ids, block_table
        self.num_computed_tokens = num_computed_tokens


def measure(runner, scheduled, steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per step of `steps` decode steps."""
    before, start = os.times(), time.perf_counter()
    for _ in range(steps):
        runner.execute_model(scheduled)
    wall, after = time.perf_counter() - start, os.times()
    return wall / steps, ((after.user - before.user) + (after.system - before.system)) / steps


def main() -> None:
    """Build a runner per precision and print the paired figures."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["float32", "bfloat16", "float32:int8"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 96])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.worker.model_runner import ModelRunner

    print(f"{args.threads} threads, load {os.getloadavg()[0]:.2f} at start")
    for entry in args.configs:
        dtype, _, quant = entry.partition(":")
        config = EngineConfig(model=args.model, dtype=dtype, device="cpu", quantization=quant or None)
        runner = ModelRunner(config)
        native = runner.native_step
        if native is None:
            print(f"{entry}: no native step here; skipped")
            continue
        blocks = -(-(CONTEXT + 1) // runner.block_size)
        for batch in args.batch_sizes:
            seqs = [Seq(list(range(100, 100 + CONTEXT)), list(range(i * blocks, (i + 1) * blocks)),
                        CONTEXT - 1) for i in range(batch)]
            scheduled = [(s, 1) for s in seqs]
            figures: dict[str, list[tuple[float, float]]] = {"python": [], "native": []}
            for mode in ("python", "native"):  # warm-up
                runner.native_step = native if mode == "native" else None
                measure(runner, scheduled, 2)
            for _ in range(args.rounds):
                for mode in ("python", "native"):
                    runner.native_step = native if mode == "native" else None
                    figures[mode].append(measure(runner, scheduled, args.steps))
            (py_wall, py_cpu), (na_wall, na_cpu) = (min(figures[m]) for m in ("python", "native"))
            print(f"{entry:14s} B={batch:3d}  python {py_wall * 1e3:7.2f} ms/step "
                  f"({batch / py_wall:6.1f} tok/s, {batch / py_cpu:6.1f} tok/CPU-s)  native "
                  f"{na_wall * 1e3:7.2f} ms/step ({batch / na_wall:6.1f} tok/s, {batch / na_cpu:6.1f} "
                  f"tok/CPU-s)  saved {(py_wall - na_wall) * 1e3:6.2f} ms/step  {py_wall / na_wall:5.2f}x  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        runner.native_step = native


if __name__ == "__main__":
    main()
