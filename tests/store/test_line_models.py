"""A line's body.model (issue 18): it runs on that model when a worker serves it (shards per model),
errors with model_not_found naming the served models otherwise, and is accepted when no worker is live."""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import orjson
import pytest

from batchinfer.config import Settings
from batchinfer.store.db import get_engine, session_factory, upgrade
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.store.line_models import ModelRouting
from batchinfer.store.models import utcnow
from batchinfer.store.shards import list_shards
from batchinfer.store.workers import register_worker


@pytest.fixture(params=["sqlite_url", pytest.param("pg_url", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    url = request.getfixturevalue(request.param)
    upgrade(url)
    yield url
    get_engine(url).dispose()


def _submit(url: str, models: list[str | None], shard_size: int = 2) -> int:
    lines = [{"custom_id": f"q{i}", "prompt": f"p{i}", **({"model": m} if m else {})}
             for i, m in enumerate(models)]
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    with session_factory(url)() as session:
        return submit_job(session, settings=Settings(database_url=url), model="base", shard_size=shard_size,
                          stream=io.BytesIO(data)).id


def _shard_models(url: str, job_id: int) -> dict[str, int]:
    with session_factory(url)() as session:
        counts: dict[str, int] = {}
        for shard in list_shards(session, job_id=job_id):
            counts[shard.model] = counts.get(shard.model, 0) + shard.num_requests
        return counts


def test_without_live_workers_a_line_model_is_accepted_and_sharded_apart(url: str) -> None:
    job_id = _submit(url, [None, "other", "base", "other", "other", None])
    assert _shard_models(url, job_id) == {"base": 3, "other": 3}
    with session_factory(url)() as session:
        assert get_job(session, job_id=job_id).failed_requests == 0


def test_a_model_no_worker_serves_is_model_not_found(url: str) -> None:
    with session_factory(url)() as session:
        register_worker(session, worker_id="w1", model="small")
        register_worker(session, worker_id="dead", model="gone", now=utcnow() - timedelta(hours=1))
    job_id = _submit(url, ["small", "gone", None, "typo"])
    assert _shard_models(url, job_id) == {"small": 1, "base": 1}
    with session_factory(url)() as session:
        errors = get_job(session, job_id=job_id).errors
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [(2, "model_not_found", "body.model"),
                                                                   (4, "model_not_found", "body.model")]
    assert errors[1]["message"] == ("line 4: body.model: model 'typo' is not served; served models: base, "
                                    "small (use one of them, or leave model out to use the job's model)")


def test_bad_model_values_name_the_field(url: str) -> None:
    data = orjson.dumps({"custom_id": "q", "prompt": "p", "model": 3}) + b"\n" + orjson.dumps(
        {"custom_id": "r", "prompt": "p"}) + b"\n"
    with session_factory(url)() as session:
        job = submit_job(session, settings=Settings(database_url=url), model="base", stream=io.BytesIO(data))
        errors = get_job(session, job_id=job.id).errors
    assert errors[0]["message"] == "line 1: model: must be a model name (a non-empty string), got a number"


def test_split_keeps_shard_order_within_each_model() -> None:
    routing = ModelRouting("base", None, {3: "b", 5: "a", 9: "b"})
    groups = routing.split(np.array([9, 1, 5, 3, 7], dtype=np.uint32))
    assert [(name, lines.tolist()) for name, lines in groups] == [("base", [1, 7]), ("a", [5]), ("b", [9, 3])]
    assert ModelRouting("base", None).split(np.array([2, 1], dtype=np.uint32))[0][1].tolist() == [2, 1]
