"""Sharing the fleet (issue 32): a small job's turnaround beside a big one, FIFO against fair share, and
the cost of one claim with many jobs queued on PostgreSQL.

    .venv/bin/python bench/fleet.py turnaround --model smollm2-135m-instruct --device cuda --big 6000
    .venv/bin/python bench/fleet.py claim --database-url postgresql+psycopg://postgres@127.0.0.1/test \\
        --jobs 10000 --owners 100

turnaround: owner A submits `--big` lines in shards of `--shard-size`; once A's first lines are written,
owner B submits `--small` lines. Prints B's turnaround (its created_at..completed_at) and how many of A's
lines were done by then, under FIFO (the claim ordered by priority, then shard id, as before issue 32) and
under fair share (store.fair_share). One polling worker in this process, on a fresh SQLite database
(or --database-url).

claim: `--jobs` single-shard jobs of `--owners` owners (inserted directly, no ingest), a usage ledger
for every owner, then `--claims` claims timed one by one (each in its own transaction, as workers do);
prints the median and p99 in milliseconds and the claim's query plan (PostgreSQL EXPLAIN ANALYZE).
The database given is emptied first: never point it at one you need.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_lines(path: Path, count: int, *, max_tokens: int, tag: str) -> None:
    with path.open("wb") as out:
        for i in range(count):
            body = {"messages": [{"role": "user", "content": f"{tag}: write a haiku about the number {i}"}],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            line = {"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            out.write(orjson.dumps(line) + b"\n")


@contextmanager
def fifo_claims():
    """Claims ordered as before issue 32 (priority, then shard id): the FIFO baseline."""
    from batchinfer.store import fair_share
    from batchinfer.store.models import Shard

    original = fair_share.fair_order
    fair_share.fair_order = lambda pick, **_: (pick, [Shard.priority, Shard.id])
    try:
        yield
    finally:
        fair_share.fair_order = original


def turnaround_once(args: argparse.Namespace, *, fifo: bool) -> dict:
    from batchinfer.config import Settings
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.jobs import get_job, submit_job
    from workers.process import make_runner, poll_forever

    work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    url = args.database_url or f"sqlite:///{work / 'fleet.db'}"
    upgrade(url)
    settings = Settings(database_url=url, data_dir=work)
    sessions = session_factory(url)
    write_lines(work / "big.jsonl", args.big, max_tokens=args.max_tokens, tag="a")
    write_lines(work / "small.jsonl", args.small, max_tokens=args.max_tokens, tag="b")

    def job(job_id: int):  # noqa: ANN202
        with sessions() as session:
            return get_job(session, job_id=job_id)

    overrides = {"device": args.device} if args.device else {}
    runner = make_runner(model=args.model, settings=settings, **overrides)
    with sessions() as session:
        big = submit_job(session, settings=settings, path=work / "big.jsonl", model=args.model, owner="alice",
                         shard_size=args.shard_size).id
    stop = threading.Event()
    with fifo_claims() if fifo else _nothing():
        thread = threading.Thread(target=poll_forever, args=(runner,), kwargs={"stop": stop}, daemon=True)
        thread.start()
        deadline = time.monotonic() + args.timeout
        while job(big).completed_requests == 0:
            if time.monotonic() > deadline:
                raise SystemExit("the big job did not start")
            time.sleep(0.02)
        with sessions() as session:
            small = submit_job(session, settings=settings, path=work / "small.jsonl", model=args.model,
                               owner="bob", shard_size=args.shard_size).id
        while job(small).status != "completed":
            if time.monotonic() > deadline:
                raise SystemExit("the small job did not complete in time")
            time.sleep(0.02)
        done = job(big).completed_requests
        stop.set()
        thread.join()
    finished = job(small)
    return {"mode": "fifo" if fifo else "fair_share", "small_turnaround_s":
            round((finished.completed_at - finished.created_at).total_seconds(), 2),
            "big_done_when_small_completed": done, "big_lines": args.big}


@contextmanager
def _nothing():
    yield


def turnaround(args: argparse.Namespace) -> None:
    for fifo in (True, False):
        print(orjson.dumps(turnaround_once(args, fifo=fifo)).decode(), flush=True)


def claim_cost(args: argparse.Namespace) -> None:
    from sqlalchemy import insert, select, text

    from batchinfer.store import fair_share, shards
    from batchinfer.store.db import get_engine, is_sqlite, session_factory, upgrade
    from batchinfer.store.models import Base, Job, JobStatus, OwnerServed, Shard, utcnow

    url = args.database_url
    engine = get_engine(url)
    Base.metadata.drop_all(engine)
    with engine.begin() as connection:
        connection.execute(text("DROP TABLE IF EXISTS alembic_version"))
    upgrade(url)
    now = utcnow()
    jobs = [{"id": i + 1, "owner": f"owner-{i % args.owners}", "model": "m", "status": JobStatus.IN_PROGRESS,
             "completion_window": "24h", "priority": 0, "shard_size": 1, "on_invalid": "skip",
             "created_at": now, "expires_at": now + timedelta(hours=1 + i % 24), "total_requests": 1}
            for i in range(args.jobs)]
    rows = [{"job_id": i + 1, "ordinal": 0, "model": "m", "priority": 0, "num_requests": 1,
             "request_lines": (1).to_bytes(4, "little"), "status": "available", "created_at": now}
            for i in range(args.jobs)]
    minute = fair_share.minute_of(now)
    ledger = [{"owner": f"owner-{o}", "minute": minute - m, "tokens": 1000 * (o + 1)}
              for o in range(args.owners) for m in range(10)]
    with engine.begin() as connection:
        for table, values in ((Job, jobs), (Shard, rows), (OwnerServed, ledger)):
            for start in range(0, len(values), 5000):
                connection.execute(insert(table), values[start:start + 5000])
    if not url.startswith("sqlite"):
        with engine.connect() as connection:  # as autovacuum would soon: the planner sees the queue's size
            connection.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
    sessions = session_factory(url)
    timings = []
    with sessions() as session:
        for n in range(args.claims):
            started = time.perf_counter()
            lease = shards.claim_shard(session, worker_id=f"w{n % 8}", model="m", lease_seconds=60)
            timings.append((time.perf_counter() - started) * 1000)
            assert lease is not None
        plan = []
        if not is_sqlite(session):
            available = select(Shard.id).where(Shard.status == "available", Shard.model == "m")
            pick, order = fair_share.fair_order(available, now=utcnow())
            statement = pick.order_by(*order).limit(1).with_for_update(skip_locked=True, of=Shard)
            compiled = statement.compile(engine, compile_kwargs={"literal_binds": True})
            plan = [row[0] for row in session.execute(text(f"EXPLAIN ANALYZE {compiled}"))]
            session.rollback()
    timings.sort()
    print(orjson.dumps({"jobs": args.jobs, "owners": args.owners, "claims": args.claims,
                        "claim_ms_median": round(statistics.median(timings), 2),
                        "claim_ms_p99": round(timings[int(len(timings) * 0.99) - 1], 2)}).decode())
    for line in plan:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("turnaround", help="a small job beside a big one: FIFO, then fair share")
    one.add_argument("--model", required=True)
    one.add_argument("--device", default=None)
    one.add_argument("--big", type=int, default=6000)
    one.add_argument("--small", type=int, default=20)
    one.add_argument("--shard-size", type=int, default=64)
    one.add_argument("--max-tokens", type=int, default=32)
    one.add_argument("--timeout", type=float, default=1800)
    one.add_argument("--database-url", default=None)
    two = commands.add_parser("claim", help="one claim's cost with many jobs queued")
    two.add_argument("--database-url", required=True)
    two.add_argument("--jobs", type=int, default=10_000)
    two.add_argument("--owners", type=int, default=100)
    two.add_argument("--claims", type=int, default=500)
    args = parser.parse_args()
    {"turnaround": turnaround, "claim": claim_cost}[args.command](args)


if __name__ == "__main__":
    main()
