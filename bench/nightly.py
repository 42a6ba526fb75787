"""Nightly pipelines with the result cache (issue 31): night 1 vs night 2 with a tenth of the lines changed,
a duplicate-heavy job, and night 2 again with the cache off, each a real `batchinfer run` on one data dir.

    .venv/bin/python bench/nightly.py --lines 120 --changed 12 --model smollm2-135m-instruct

Night 1 runs `--lines` deterministic lines (half greedy, half seeded sampling); night 2 is the same file
with `--changed` prompts edited: it must compute only those (the rest are hits equal to night 1's
choices), and its wall time (process start to exit, model load included) is printed beside night 1's. The
duplicate job is `--distinct` prompts x `--copies` custom_ids. `--result-cache off` recomputes night 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]


def write_night(path: Path, prompts: list[str], *, max_tokens: int, seeds: bool = True) -> None:
    """Half greedy, half seeded sampling (seed by line; all greedy without `seeds`): every line
    deterministic."""
    with path.open("wb") as out:
        for i, prompt in enumerate(prompts):
            sampled = seeds and i % 2
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    **({"temperature": 0.8, "seed": 1000 + i} if sampled else {"temperature": 0})}
            out.write(orjson.dumps({"custom_id": f"item-{i:05d}", "method": "POST",
                                    "url": "/v1/chat/completions", "body": body}) + b"\n")


def run(input_path: Path, output: Path, env: dict[str, str], *extra: str) -> tuple[float, dict, list[dict]]:
    """One `batchinfer run`: (wall seconds, the batch object, the output lines)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchinfer", "run", str(input_path), "-o", str(output),
                           "--json", *extra], env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"batchinfer run failed ({done.returncode}): {done.stderr[-2000:]}")
    batch = orjson.loads(done.stdout.strip().splitlines()[-1])
    lines = [orjson.loads(line) for line in output.read_bytes().splitlines() if line.strip()]
    return wall, batch, lines


def describe(name: str, wall: float, batch: dict, lines: list[dict]) -> str:
    sources = Counter(line["provenance"]["result_cache"] for line in lines)
    return (f"{name:<22} {wall:7.2f} s  {len(lines):5d} lines  computed {sources['miss']:5d}  "
            f"hits {sources['hit']:5d}  dedup {sources['dedup']:5d}  (batch {batch['result_cache']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lines", type=int, default=120)
    parser.add_argument("--changed", type=int, default=12)
    parser.add_argument("--distinct", type=int, default=4)
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-nightly-") as tmp_dir:
        tmp = Path(tmp_dir)
        env = {**os.environ, "BATCHINFER_DATA_DIR": str(tmp / "data"), "BATCHINFER_DEFAULT_MODEL": args.model,
               "BATCHINFER_DEVICE": args.device, "PYTHONPATH": str(ROOT)}
        prompts = [f"Write one sentence about product number {i} of our catalogue."
                   for i in range(args.lines)]
        changed = set(range(0, args.lines, max(1, args.lines // max(1, args.changed))))
        changed = set(sorted(changed)[:args.changed])
        write_night(tmp / "night1.jsonl", prompts, max_tokens=args.max_tokens)
        edited = [p + " (new)" if i in changed else p for i, p in enumerate(prompts)]
        write_night(tmp / "night2.jsonl", edited, max_tokens=args.max_tokens)
        dup_prompts = [f"Summarise review {i % args.distinct} in five words." for i in
                       range(args.distinct * args.copies)]
        write_night(tmp / "dups.jsonl", dup_prompts, max_tokens=args.max_tokens, seeds=False)

        first = run(tmp / "night1.jsonl", tmp / "out1.jsonl", env)
        second = run(tmp / "night2.jsonl", tmp / "out2.jsonl", env)
        off = run(tmp / "night2.jsonl", tmp / "out3.jsonl", env, "--result-cache", "off")
        dups = run(tmp / "dups.jsonl", tmp / "out4.jsonl", env)

        print(f"model {args.model}, {args.lines} lines (max_tokens {args.max_tokens}), "
              f"{len(changed)} changed")
        print(describe("night 1", *first))
        print(describe("night 2", *second))
        print(describe("night 2, cache off", *off))
        print(describe(f"{args.distinct} x {args.copies} duplicates", *dups))
        print(f"night 2 / night 1 wall time: {second[0] / first[0]:.2f}x")
        same = all(a["response"]["body"]["choices"] == b["response"]["body"]["choices"]
                   for i, (a, b) in enumerate(zip(first[2], second[2], strict=True)) if i not in changed)
        print(f"hits equal night 1's choices: {same}")


if __name__ == "__main__":
    main()
