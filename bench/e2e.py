"""End-to-end overhead of the job system: the same job through LLM.generate, the local mode, and Celery.

    .venv/bin/python bench/e2e.py --num-requests 2000

(a) `LLM.generate` on the prompts directly (no database), (b) the local mode (SQLite, submit + in-process
ShardRunner + export), (c) Celery + Redis + PostgreSQL with one worker process (submit + dispatch + the
worker + export). Prints tokens/s of each and the overhead of (b) and (c) against (a). Every mode runs the
same greedy requests with ignore_eos and fixed max_tokens, so all three generate the same token count.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEM = ("You are a support assistant for an online bookshop. Answer in two sentences, be concrete, and "
          "recommend at most one book.")
TOPICS = ["science fiction", "cooking", "gardening", "history of Rome", "jazz", "chess", "birds", "poetry",
          "mountaineering", "databases", "sailing", "astronomy", "photography", "tea", "cycling", "origami"]


def write_job(path: Path, count: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """Chat requests with one shared system prompt; returns the request bodies."""
    rng = random.Random(seed)
    bodies = []
    with path.open("wb") as out:
        for i in range(count):
            topic, liked = rng.choice(TOPICS), rng.choice(TOPICS)
            question = f"Which book about {topic} would you give a friend who likes {liked}?"
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            bodies.append(body)
            out.write(orjson.dumps({"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + b"\n")
    return bodies


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "device": args.device}


def run_direct(args: argparse.Namespace, bodies: list[dict]) -> tuple[float, int]:
    from batchinfer.engine.llm import LLM
    from batchinfer.engine.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.chat([b["messages"] for b in bodies], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_local(args: argparse.Namespace, path: Path, workdir: Path) -> tuple[float, int]:
    from batchinfer.config import Settings
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.export import export_results
    from batchinfer.store.jobs import get_job, submit_job
    from workers.process import make_runner, run_job

    url = f"sqlite:///{workdir / 'local.db'}"
    upgrade(url)
    settings = Settings(database_url=url, data_dir=workdir, shard_size=args.shard_size)
    runner = make_runner(model=args.model, settings=settings, **engine_kwargs(args))  # load outside the clock
    sessions = session_factory(url)
    start = time.perf_counter()
    with sessions() as session:
        job = submit_job(session, settings=settings, path=path, model=args.model, owner="bench")
    run_job(job_id=job.id, runner=runner)
    with sessions() as session:
        lines = sum(1 for _ in export_results(session, job_id=job.id))
        job = get_job(session, job_id=job.id)
    elapsed = time.perf_counter() - start
    assert lines == args.num_requests, f"local mode exported {lines} lines"
    return elapsed, job.completion_tokens


def run_celery(args: argparse.Namespace, path: Path, workdir: Path) -> tuple[float, int]:
    import sqlalchemy as sa

    from batchinfer.config import Settings
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.export import export_results
    from batchinfer.store.jobs import get_job
    from workers.app import create_celery_app
    from workers.dispatch import submit_and_announce

    name = f"bi_bench_{os.getpid()}"
    admin = sa.create_engine(args.postgres, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(args.postgres).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    settings = Settings(database_url=url, broker_url=args.redis, data_dir=workdir, shard_size=args.shard_size)
    env = {**os.environ, "BATCHINFER_DATABASE_URL": url, "BATCHINFER_BROKER_URL": args.redis,
           "BATCHINFER_DATA_DIR": str(workdir), "BATCHINFER_DEVICE": args.device,
           "BATCHINFER_MAX_NUM_SEQS": str(args.max_num_seqs),
           "BATCHINFER_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens)}
    log = (workdir / "worker.log").open("wb")
    worker = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "worker", "--model", args.model],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Load the engine before the clock starts, as a long-lived worker would have: a warm-up job.
        warm = workdir / "warm.jsonl"
        write_job(warm, 1, 2)
        app = create_celery_app(settings)
        sessions = session_factory(url)
        with sessions() as session:
            warm_job = submit_and_announce(session=session, settings=settings, app=app, path=warm,
                                           model=args.model, owner="bench")
        _wait_done(sessions, warm_job.id, worker, workdir)
        start = time.perf_counter()
        with sessions() as session:
            job = submit_and_announce(session=session, settings=settings, app=app, path=path,
                                      model=args.model, owner="bench")
        _wait_done(sessions, job.id, worker, workdir)
        with sessions() as session:
            lines = sum(1 for _ in export_results(session, job_id=job.id))
            job = get_job(session, job_id=job.id)
        elapsed = time.perf_counter() - start
        assert lines == args.num_requests, f"celery mode exported {lines} lines"
        return elapsed, job.completion_tokens
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _wait_done(sessions, job_id: int, worker: subprocess.Popen, workdir: Path) -> None:  # noqa: ANN001
    from batchinfer.store.jobs import get_job
    from batchinfer.store.models import JOB_TERMINAL_STATUSES

    while True:
        with sessions() as session:
            if get_job(session, job_id=job_id).status in JOB_TERMINAL_STATUSES:
                return
        if worker.poll() is not None:
            raise RuntimeError("worker died:\n" + (workdir / "worker.log").read_text()[-3000:])
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--postgres", default=os.environ.get(
        "BATCHINFER_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis", default=os.environ.get(
        "BATCHINFER_TEST_REDIS_URL", "redis://127.0.0.1:6379/3"))
    parser.add_argument("--modes", default="direct,local,celery")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    workdir = Path(tempfile.mkdtemp(prefix="bi-e2e-"))
    path = workdir / "job.jsonl"
    bodies = write_job(path, args.num_requests, args.max_tokens)
    results: dict[str, tuple[float, int]] = {}
    modes = args.modes.split(",")
    if "direct" in modes:
        results["(a) LLM.generate"] = run_direct(args, bodies)
    if "local" in modes:
        results["(b) local mode (SQLite)"] = run_local(args, path, workdir)
    if "celery" in modes:
        results["(c) Celery + Redis + PostgreSQL, 1 worker"] = run_celery(args, path, workdir)

    base = results.get("(a) LLM.generate")
    print(f"\n{args.num_requests} requests x {args.max_tokens} tokens on {args.model} ({args.device})\n")
    print("| mode | seconds | generated tokens | tokens/s | overhead vs (a) |")
    print("|---|---|---|---|---|")
    for name, (seconds, tokens) in results.items():
        overhead = f"{100 * (seconds / base[0] - 1):+.1f}%" if base else "-"
        print(f"| {name} | {seconds:.1f} | {tokens} | {tokens / seconds:.1f} | {overhead} |")


if __name__ == "__main__":
    main()
