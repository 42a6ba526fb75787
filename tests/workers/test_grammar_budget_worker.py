"""Issue 28 item 3, as an operator sees it: a worker whose grammar compilation runs past
grammar_compile_timeout_seconds errors that request alone, naming the setting, and runs the rest."""

from __future__ import annotations

import random
import string
from pathlib import Path

import orjson

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import submit_job
from workers.process import make_runner, run_job


def _line(custom_id: str, choices: list[str]) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "pick one", "max_tokens": 60, "guided_choice": choices}})


def test_a_grammar_past_the_compile_timeout_errors_its_line_and_the_rest_run(sqlite_url: str, tmp_path: Path,
                                                                             tiny_llama: Path) -> None:
    upgrade(sqlite_url)
    rng = random.Random(0)
    # ~1.5 s to compile on the tiny vocab (2 xgrammar threads; 4,500 choices took 0.9 s on the AVX-512 bench
    # machine, under the 1 s this test used to allow), against a 0.25 s budget; ["yes", "no"] takes < 1 ms
    slow = ["".join(rng.choices(string.ascii_letters, k=50)) for _ in range(6000)]
    (tmp_path / "in.jsonl").write_bytes(_line("slow", slow) + b"\n" + _line("quick", ["yes", "no"]) + b"\n")
    ingest = Settings(database_url=sqlite_url, data_dir=tmp_path)  # its conversion is quick: it ingests
    with session_factory(sqlite_url)() as session:
        job = submit_job(session, settings=ingest, path=tmp_path / "in.jsonl", model=str(tiny_llama))
    assert not job.errors
    worker = Settings(database_url=sqlite_url, data_dir=tmp_path, grammar_compile_timeout_seconds=0.25)
    runner = make_runner(model=str(tiny_llama), settings=worker, device="cpu", kv_cache_memory_bytes=16 << 20)
    try:
        run_job(job_id=job.id, runner=runner)
    finally:
        runner.engine.grammar_backend.close()  # waits for the dropped compilation to end
    with session_factory(sqlite_url)() as session:
        errors = [orjson.loads(line) for line in export_results(session, job_id=job.id, kind="errors")]
        results = [orjson.loads(line) for line in export_results(session, job_id=job.id, kind="output")]
    assert [e["custom_id"] for e in errors] == ["slow"]
    assert errors[0]["error"] == {"code": "invalid_request", "message": (
        "line 1: structured_outputs: compiling the choice constraint took longer than 0.25 s "
        "(grammar_compile_timeout_seconds); simplify it")}
    assert [r["custom_id"] for r in results] == ["quick"]
    assert results[0]["response"]["body"]["choices"][0]["text"] in ("yes", "no")
