"""The result cache across jobs and dedup within a job (issue 31), on a real engine and database.

Night 1 computes, night 2 with a few prompts changed serves the rest from night 1 without the engine;
identical lines of one job are computed once and copied; `off` and `refresh` compute; evicted bodies are
recomputed; provenance names where each body came from. Rows reference their bodies (no copy per job):
a body a job's rows reference is never evicted or purged, and a refresh never changes an earlier output.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import func, select

from batchinfer.config import Settings
from batchinfer.store import result_cache as cache_store
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.models import Request, ResultBody
from batchinfer.store.result_files import delete_result_file
from workers.process import make_runner, run_job


def _write(path: Path, prompts: list[str], *, custom_ids: list[str] | None = None,
           sampled: bool = False, greedy: bool = False) -> None:
    """Chat lines: even ones greedy, odd ones seeded sampling (unseeded sampling with `sampled`, all greedy
    with `greedy`)."""
    with path.open("wb") as out:
        for i, prompt in enumerate(prompts):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
            if sampled:
                body["temperature"] = 1.0
            elif i % 2 and not greedy:
                body.update({"temperature": 0.9, "seed": 7 + i})
            else:
                body["temperature"] = 0
            custom_id = custom_ids[i] if custom_ids else f"line-{i:04d}"
            out.write(orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + b"\n")


class Nights:
    """One data dir and database, a runner on the tiny model, jobs submitted and run like `batchinfer run`."""

    def __init__(self, url: str, model: Path, tmp_path: Path, **settings: object) -> None:
        upgrade(url)
        self.settings = Settings(database_url=url, data_dir=tmp_path, write_batch_size=8, **settings)
        self.sessions = session_factory(url)
        self.runner = make_runner(model=str(model), settings=self.settings, max_num_seqs=16, device="cpu")
        self.tmp_path = tmp_path

    def copied_bytes(self, job_id: int) -> int:
        """Bytes of response bodies the job's own rows hold (a row referencing a cached body holds none)."""
        with self.sessions() as session:
            return int(session.scalar(select(func.coalesce(func.sum(func.length(Request.response)), 0))
                                      .where(Request.job_id == job_id)) or 0)

    def cached(self, *, pinned: bool = False) -> tuple[int, int]:
        """(bodies, bytes) of the result cache."""
        with self.sessions() as session:
            return cache_store.cache_size(session, pinned=pinned)

    def delete_output(self, job_id: int, owner: str = "t") -> None:
        """Delete a job's output file (its succeeded rows): the bodies they referenced are evictable."""
        with self.sessions() as session:
            assert delete_result_file(session, owner=owner, job_id=job_id, kind="output")

    def run(self, path: Path, *, owner: str = "t", shard_size: int = 32, **submit: object):
        with self.sessions() as session:
            job = submit_job(session, settings=self.settings, path=path, model=self.runner.model, owner=owner,
                             shard_size=shard_size, **submit)
        stats = run_job(job_id=job.id, runner=self.runner)
        with self.sessions() as session:
            job = get_job(session, job_id=job.id)
            lines = [orjson.loads(line) for line in export_results(session, job_id=job.id)]
        assert job.status == "completed"
        return job, stats, lines


def _night_two(url: str, model: Path, tmp_path: Path) -> None:
    nights = Nights(url, model, tmp_path)
    prompts = [f"the cat reads prompt {i}" for i in range(120)]
    first_file = tmp_path / "night1.jsonl"
    _write(first_file, prompts)
    job1, stats1, night1 = nights.run(first_file)
    assert stats1.requests_finished == 120
    assert {line["provenance"]["result_cache"] for line in night1} == {"miss"}

    changed = set(range(3, 120, 10))  # 12 prompts edited
    second_file = tmp_path / "night2.jsonl"
    _write(second_file, [p + " (edited)" if i in changed else p for i, p in enumerate(prompts)])
    job2, stats2, night2 = nights.run(second_file)
    assert stats2.requests_finished == 12  # only the changed lines reached the engine
    assert [line["custom_id"] for line in night2] == [line["custom_id"] for line in night1]
    sources = Counter(line["provenance"]["result_cache"] for line in night2)
    assert sources == {"hit": 108, "miss": 12}
    assert (job2.result_cache_hits, job2.result_cache_dedups) == (108, 0)
    for i, (old, new) in enumerate(zip(night1, night2, strict=True)):
        provenance = new["provenance"]
        if i in changed:
            assert provenance["result_cache"] == "miss" and provenance["computed_in"] == job2.batch_id
            continue
        assert provenance["computed_in"] == job1.batch_id
        old_body, new_body = old["response"]["body"], new["response"]["body"]
        assert new_body["choices"] == old_body["choices"]  # the body first computed, every field
        assert new_body["usage"] == old_body["usage"]
        assert new_body["model"] == old_body["model"]
    # provenance on every line: engine, model, its fingerprint, dtype, seed
    line = night2[1]["provenance"]
    assert line["engine"]["name"] == "batchinfer" and line["engine"]["version"]
    assert len(line["model_fingerprint"]) == 64 and line["dtype"] in ("float32", "bfloat16")
    assert line["seed"] == 8 and line["adapter"] is None and line["quantization"] is None
    assert night2[0]["provenance"]["seed"] is None
    # one body per key, referenced by both nights' rows: no copy in either job's rows
    assert nights.cached() == nights.cached(pinned=True) and nights.cached()[0] == 132
    assert nights.copied_bytes(job1.id) == nights.copied_bytes(job2.id) == 0
    with nights.sessions() as session:
        bodies = session.scalar(select(func.sum(ResultBody.size)))
    assert bodies < sum(len(orjson.dumps(line)) for line in night1 + night2) / 2

    _, stats_off, off_lines = nights.run(second_file, result_cache="off")
    assert stats_off.requests_finished == 120
    assert {line["provenance"]["result_cache"] for line in off_lines} == {"miss"}


def test_night_two_computes_only_what_changed_sqlite(sqlite_url: str, tiny_llama: Path,
                                                     tmp_path: Path) -> None:
    _night_two(sqlite_url, tiny_llama, tmp_path)


@pytest.mark.postgres
def test_night_two_computes_only_what_changed_postgres(pg_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    _night_two(pg_url, tiny_llama, tmp_path)


def test_unseeded_sampling_never_hits(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    nights = Nights(sqlite_url, tiny_llama, tmp_path)
    path = tmp_path / "sampled.jsonl"
    _write(path, ["a sampled prompt"] * 3 + ["another"], sampled=True)
    for _ in range(2):
        job, stats, lines = nights.run(path)
        assert stats.requests_finished == 4  # twins included: nothing deterministic to share
        assert {line["provenance"]["result_cache"] for line in lines} == {"miss"}
        assert all(line["provenance"]["seed"] is None for line in lines)
        assert job.result_cache_hits == job.result_cache_dedups == 0


def _dedup(url: str, model: Path, tmp_path: Path) -> None:
    nights = Nights(url, model, tmp_path)
    prompts = [f"question {i % 4} about cats" for i in range(40)]  # 4 prompts x 10 custom_ids
    path = tmp_path / "dups.jsonl"
    _write(path, prompts, custom_ids=[f"c{i}" for i in range(40)], greedy=True)  # twins: identical requests
    labels = nights.runner.metrics.labels
    before = REGISTRY.get_sample_value("batchinfer:result_cache_dedup_total", labels) or 0.0
    job, stats, lines = nights.run(path, shard_size=7)  # twins in different shards
    assert REGISTRY.get_sample_value("batchinfer:result_cache_dedup_total", labels) - before == 36
    assert job.num_shards == 6
    assert stats.requests_finished == 4
    assert sorted(line["custom_id"] for line in lines) == sorted(f"c{i}" for i in range(40))
    assert Counter(line["provenance"]["result_cache"] for line in lines) == {"miss": 4, "dedup": 36}
    assert job.result_cache_dedups == 36
    by_prompt: dict[str, set[bytes]] = {}
    for line in lines:
        prompt = prompts[int(line["custom_id"][1:])]
        by_prompt.setdefault(prompt, set()).add(orjson.dumps(line["response"]["body"]["choices"]))
        assert line["provenance"]["computed_in"] == job.batch_id
    assert all(len(bodies) == 1 for bodies in by_prompt.values())
    assert nights.cached()[0] == 4 and nights.copied_bytes(job.id) == 0  # 40 rows, 4 bodies


def test_dedup_within_a_job_sqlite(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    _dedup(sqlite_url, tiny_llama, tmp_path)


@pytest.mark.postgres
def test_dedup_within_a_job_postgres(pg_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    _dedup(pg_url, tiny_llama, tmp_path)


def test_refresh_recomputes_and_replaces(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    nights = Nights(sqlite_url, tiny_llama, tmp_path)
    path = tmp_path / "in.jsonl"
    _write(path, [f"prompt {i}" for i in range(6)])
    first_job, _, first = nights.run(path)
    job, stats, lines = nights.run(path, result_cache="refresh")
    assert stats.requests_finished == 6
    assert {line["provenance"]["result_cache"] for line in lines} == {"miss"}
    _, stats, lines = nights.run(path)
    assert stats.requests_finished == 0  # served without the engine ...
    assert {line["provenance"]["computed_in"] for line in lines} == {job.batch_id}  # ... from the refresh
    with nights.sessions() as session:  # the first job's output is what it was, body for body
        assert [orjson.loads(line) for line in export_results(session, job_id=first_job.id)] == first


def test_evicted_bodies_are_recomputed(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    nights = Nights(sqlite_url, tiny_llama, tmp_path)
    path = tmp_path / "in.jsonl"
    _write(path, [f"prompt {i}" for i in range(8)])
    job1, _, first = nights.run(path)
    with nights.sessions() as session:
        bodies, size = cache_store.cache_size(session)
        assert bodies == 8 and size > 0
        assert cache_store.evict(session, max_bytes=0) == 0  # night 1's rows reference them all: pinned
        assert [orjson.loads(line) for line in export_results(session, job_id=job1.id)] == first
    nights.delete_output(job1.id)  # nothing references them now
    with nights.sessions() as session:
        assert cache_store.evict(session, max_bytes=size // 2) >= 4  # least recently used first
        left, _ = cache_store.cache_size(session)
    job, stats, lines = nights.run(path)
    assert stats.requests_finished == 8 - left  # evicted ones computed again, the job complete
    assert Counter(line["provenance"]["result_cache"] for line in lines) == {"hit": left, "miss": 8 - left}
    assert [line["response"]["body"]["choices"] for line in lines] == [
        line["response"]["body"]["choices"] for line in first]


def test_cache_bound_keeps_at_most_max_bytes(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    nights = Nights(sqlite_url, tiny_llama, tmp_path, result_cache_max_bytes=2000)
    path, other = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
    _write(path, [f"prompt {i}" for i in range(12)])
    _write(other, [f"another prompt {i}" for i in range(12)])
    job1, _, _ = nights.run(path)
    bodies, size = nights.cached()
    assert bodies == 12 and size > 2000  # referenced by night 1's rows: pinned, counted over the bound
    assert nights.cached(pinned=True) == (bodies, size)
    nights.delete_output(job1.id)
    job2, _, _ = nights.run(other)  # its writes enforce the bound: night 1's bodies, unreferenced now, go
    assert nights.cached() == nights.cached(pinned=True)
    assert nights.cached()[0] == 12
    nights.delete_output(job2.id)
    with nights.sessions() as session:
        cache_store.evict(session, max_bytes=2000)
    bodies, size = nights.cached()
    assert 0 < bodies < 12 and size <= 2000
    _, stats, _ = nights.run(other)  # whatever was evicted runs again; the job completes
    assert stats.requests_finished == 12 - bodies


def test_owners_do_not_share_results(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    nights = Nights(sqlite_url, tiny_llama, tmp_path)
    path = tmp_path / "in.jsonl"
    _write(path, [f"prompt {i}" for i in range(4)])
    nights.run(path, owner="alice")
    _, stats, lines = nights.run(path, owner="bob")
    assert stats.requests_finished == 4  # another owner's identical request is a miss (a hit is an oracle)
    assert {line["provenance"]["result_cache"] for line in lines} == {"miss"}
    _, stats, _ = nights.run(path, owner="alice")
    assert stats.requests_finished == 0


def test_global_scope_shares_results(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    nights = Nights(sqlite_url, tiny_llama, tmp_path, prefix_cache_scope="global")
    path = tmp_path / "in.jsonl"
    _write(path, [f"prompt {i}" for i in range(4)])
    nights.run(path, owner="alice")
    _, stats, lines = nights.run(path, owner="bob")
    assert stats.requests_finished == 0
    assert {line["provenance"]["result_cache"] for line in lines} == {"hit"}


def test_purged_bodies_are_recomputed(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    from datetime import timedelta

    from batchinfer.store.models import utcnow
    from batchinfer.store.retention import purge

    nights = Nights(sqlite_url, tiny_llama, tmp_path, finished_job_retention_seconds=3600)
    path = tmp_path / "in.jsonl"
    _write(path, [f"prompt {i}" for i in range(6)])
    job1, _, first = nights.run(path)
    with nights.sessions() as session:  # bodies night 1's rows reference stay while they do
        assert purge(session, settings=nights.settings).result_bodies == 0
        assert cache_store.purge_unused(session, older_than_s=0, now=utcnow() + timedelta(hours=2)) == 0
    with nights.sessions() as session:  # two hours on: night 1's job and its unused bodies go
        report = purge(session, settings=nights.settings, now=utcnow() + timedelta(hours=2))
        assert report.jobs == [job1.id] and report.result_bodies == 6
    _, stats, lines = nights.run(path)
    assert stats.requests_finished == 6  # nothing left to serve: computed again, the job complete
    assert [line["response"]["body"]["choices"] for line in lines] == [
        line["response"]["body"]["choices"] for line in first]
