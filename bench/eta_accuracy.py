"""How good is the ETA? Run a job through `batchinfer run` and compare the ETA it showed with the truth.

A fresh data dir, a `batchinfer run` subprocess on LINES chat requests of varied budgets (max_tokens 48 to
192, temperature 0: SmolLM2 stops at EOS well before most caps, so the budgets alone overestimate), and a
poll of the batch object (what `status --json` prints) every 0.25 s. For each poll after the first claim,
the error is |predicted end - actual end| / actual time left; printed at 25, 50 and 75% of the run.

    .venv/bin/python bench/eta_accuracy.py [--model smollm2-135m-instruct] [--lines 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

QUESTIONS = ["How much is a croissant?", "Write a haiku about bread.", "List three uses of flour.",
             "Explain how yeast makes dough rise.", "What is the capital of France?",
             "Describe a perfect breakfast in detail.", "Say hello.", "Tell a short story about a baker."]


def write_workload(path: Path, lines: int) -> None:
    """LINES chat requests, budgets 48..192 tokens, greedy."""
    with path.open("wb") as out:
        for i in range(lines):
            body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    "max_tokens": 48 + 48 * (i % 4), "temperature": 0}
            out.write(orjson.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + b"\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lines", type=int, default=40)
    args = parser.parse_args()
    from batchinfer.store.db import session_factory
    from batchinfer.store.jobs import get_job
    from batchinfer.store.serialize import current_batch_object

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_workload(Path(tmp) / "in.jsonl", args.lines)
        env = {**os.environ, "BATCHINFER_DATA_DIR": str(data)}
        run = subprocess.Popen([sys.executable, "-m", "batchinfer", "run", str(Path(tmp) / "in.jsonl"), "-o",
                                str(Path(tmp) / "out.jsonl"), "-m", args.model], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples: list[tuple[float, float | None]] = []  # (wall time, eta) once claimed
        end = None
        sessions = None
        while run.poll() is None or end is None:
            time.sleep(0.25)
            if sessions is None:
                if not (data / "batchinfer.db").exists():
                    continue
                sessions = session_factory(f"sqlite:///{data / 'batchinfer.db'}")
            try:
                with sessions() as session:
                    job = get_job(session, job_id=1)
                    found = None if job is None else current_batch_object(session, job)
                    batch = None if found is None else found.model_dump(mode="json")
            except Exception:  # noqa: BLE001 - the database is being created: poll again
                continue
            if batch is None:
                continue
            if batch["status"] != "in_progress":
                end = time.time()
                if run.poll() is not None:
                    break
                continue
            if batch["progress"]["started_at"] is not None:
                samples.append((time.time(), batch["progress"]["eta_seconds"]))
                if os.environ.get("ETA_TRACE"):
                    progress, counts = batch["progress"], batch["request_counts"]
                    print(f"{time.time():.1f} done {counts['completed']} gen {progress['generated_tokens']} "
                          f"left {progress['remaining_tokens']} tps {progress['tokens_per_second']} "
                          f"eta {progress['eta_seconds']}", file=sys.stderr)
        run.wait()
        if not samples or end is None:
            sys.exit("the job never ran (is the model available?)")
        start = samples[0][0]
        print(f"{args.lines} lines on {args.model}: {end - start:.1f} s from the first claim")
        for share in (0.25, 0.5, 0.75):
            at, eta = min(samples, key=lambda s: abs(s[0] - (start + share * (end - start))))
            left = end - at
            error = "no ETA" if eta is None else f"{abs(at + eta - end) / left:.0%}"
            print(f"  at {share:.0%}: ETA {eta} s, actual {left:.1f} s left, error {error}")


if __name__ == "__main__":
    main()
