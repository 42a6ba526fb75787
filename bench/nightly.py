"""Nightly pipelines with the result cache (issue 31): night 1 vs night 2 with a tenth of the lines changed,
a duplicate-heavy job, and night 2 again with the cache off, each a real `batchinfer run` on one data dir.

    .venv/bin/python bench/nightly.py --lines 120 --changed 12 --model smollm2-135m-instruct

Night 1 runs `--lines` deterministic lines (half greedy, half seeded sampling); night 2 is the same file
with `--changed` prompts edited: it must compute only those (the rest are hits equal to night 1's
choices), and its wall time (process start to exit, model load included) is printed beside night 1's. The
duplicate job is `--distinct` prompts x `--copies` custom_ids. `--result-cache off` recomputes night 2.
Each run also prints the tokens it computed per second and per CPU-second (the process's user + system
time), and the CPU kind is printed first: figures of a shared machine are read as ratios of one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]

JsonObject = dict[str, object]  # a batch object or an output line, as orjson reads it


@dataclass(frozen=True)
class Night:
    """One `batchinfer run`: its wall and CPU seconds, the batch object and the output lines."""

    wall: float
    cpu: float  # user + system seconds of the process
    batch: JsonObject
    lines: list[dict]

    def sources(self) -> Counter[str]:
        """Lines by provenance.result_cache: miss (computed here), hit, dedup."""
        return Counter(line["provenance"]["result_cache"] for line in self.lines)

    def computed_tokens(self) -> int:
        """Completion tokens this run computed (its misses; hits and copies cost no token)."""
        return sum(line["response"]["body"]["usage"]["completion_tokens"] for line in self.lines
                   if line["provenance"]["result_cache"] == "miss")


def cpu_kind() -> str:
    """The CPU model and the flags that pick dtypes and kernels (bf16, VNNI, AMX)."""
    from batchinfer.engine.native.cpu_features import NATIVE_BF16_CPU_FLAGS, VNNI_CPU_FLAGS, cpu_flags

    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            names = (line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
            name = next(names, name)
    except OSError:
        pass
    flags = cpu_flags()
    features = [flag for flag in ("avx512f", *NATIVE_BF16_CPU_FLAGS, *VNNI_CPU_FLAGS) if flag in flags]
    amx = "AMX" if any(flag.startswith("amx") for flag in flags) else "no AMX"
    return f"{name}, {os.cpu_count()} cores, {' '.join(features) or 'no AVX-512'}, {amx}"


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


def timed_child(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall, user + system CPU seconds, stdout) of one child process; exits on its failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({done.returncode}): {done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def run(input_path: Path, output: Path, env: dict[str, str], *extra: str) -> Night:
    """One `batchinfer run` of `input_path` in a fresh process."""
    wall, cpu, stdout = timed_child([sys.executable, "-m", "batchinfer", "run", str(input_path), "-o",
                                     str(output), "--json", *extra], env)
    batch = orjson.loads(stdout.strip().splitlines()[-1])
    lines = [orjson.loads(line) for line in output.read_bytes().splitlines() if line.strip()]
    return Night(wall, cpu, batch, lines)


def describe(name: str, night: Night) -> str:
    """One row: times, what the lines came from, computed tokens per second and per CPU-second."""
    sources, tokens = night.sources(), night.computed_tokens()
    return (f"{name:<22} {night.wall:6.2f} s  cpu {night.cpu:6.2f} s  {len(night.lines):4d} lines  "
            f"computed {sources['miss']:4d}  hits {sources['hit']:4d}  dedup {sources['dedup']:4d}  "
            f"{tokens:5d} tokens: {tokens / night.wall:6.1f} tok/s, {tokens / max(night.cpu, 1e-9):6.1f} "
            f"tok/CPU-s  (batch {night.batch['result_cache']})")


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

        print(f"CPU: {cpu_kind()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"model {args.model}, {args.lines} lines (max_tokens {args.max_tokens}), "
              f"{len(changed)} changed")
        print(describe("night 1", first))
        print(describe("night 2", second))
        print(describe("night 2, cache off", off))
        print(describe(f"{args.distinct} x {args.copies} duplicates", dups))
        print(f"night 2 / night 1 wall time: {second.wall / first.wall:.2f}x, CPU time: "
              f"{second.cpu / first.cpu:.2f}x")
        same = all(a["response"]["body"]["choices"] == b["response"]["body"]["choices"]
                   for i, (a, b) in enumerate(zip(first.lines, second.lines, strict=True))
                   if i not in changed)
        print(f"hits equal night 1's choices: {same}")


if __name__ == "__main__":
    main()
