"""A worker serving LoRA adapters (settings.lora_modules, `--lora-modules`): it advertises them like models,
ingest routes a line's body.model = NAME to that adapter's shards (an unknown name is model_not_found
listing the base and the adapters), and the worker claims those shards and runs them under the adapter,
matching transformers with the adapter merged.
"""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import submit_job
from batchinfer.store.workers import served_models
from tests.fixtures.tiny_lora import MergedReference, build_lora_adapter
from workers.process import make_runner

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lora_adapter(tiny_llama, tmp_path_factory.mktemp("worker_lora") / "sql", seed=31)


def test_worker_serves_its_adapters_like_models(sqlite_url: str, tmp_path: Path, tiny_llama: Path,
                                                adapter: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, lora_modules={"sql": str(adapter)},
                        dtype="float32")
    runner = make_runner(model=str(tiny_llama), settings=settings, device="cpu",
                         kv_cache_memory_bytes=16 << 20)
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        assert served_models(session) == sorted([str(tiny_llama), "sql"])
    monkeypatch.setenv("BATCHINFER_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path))
    listed = CliRunner().invoke(main, ["workers", "--json"], catch_exceptions=False)
    assert orjson.loads(listed.output)["lora_adapters"] == ["sql"]  # `batchinfer workers` shows them
    prompts = ["the cat reads the prompt", "a worker counts many tokens", "our server sorts the results"]
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0}
    lines = [{"custom_id": f"sql-{i}", "body": {"prompt": p, **greedy, "model": "sql"}}
             for i, p in enumerate(prompts)]
    lines += [{"custom_id": f"base-{i}", "body": {"prompt": p, **greedy}} for i, p in enumerate(prompts)]
    lines.append({"custom_id": "unknown", "body": {"prompt": "hi", "max_tokens": 1, "model": "sql-v2"}})
    data = b"".join(orjson.dumps({"method": "POST", "url": "/v1/completions", **line}) + b"\n"
                    for line in lines)
    with sessions() as session:
        job = submit_job(session, settings=settings, stream=io.BytesIO(data), model=str(tiny_llama))
    runner.work()  # as a worker does: the shards of its model, then those of each adapter
    with sessions() as session:
        out = {line["custom_id"]: line for line in map(orjson.loads, export_results(session, job_id=job.id))}
        errors = list(map(orjson.loads, export_results(session, job_id=job.id, kind="errors")))
    assert len(out) == 6 and len(errors) == 1 and errors[0]["error"]["code"] == "model_not_found"
    assert f"served models: {tiny_llama}, sql (" in errors[0]["error"]["message"]
    reference = MergedReference(tiny_llama)
    for i, prompt in enumerate(prompts):
        for name, expected_adapter in (("sql", adapter), ("base", None)):
            body = out[f"{name}-{i}"]["response"]["body"]
            assert body["model"] == ("sql" if name == "sql" else str(tiny_llama))
            ours = body["choices"][0]["text"].rstrip("\ufffd"), body["usage"]["completion_tokens"]
            assert ours == reference.completion(expected_adapter, prompt, MAX_TOKENS), (name, i)
