"""/v1/embeddings lines: ingest checks, the engine's pooled embedding against transformers, a local run."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import orjson
import pytest
import torch

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import get_job, submit_job
from batchinfer.wire.input_line import parse_line
from batchinfer.wire.output_line import read_output_line
from batchinfer.wire.request import Endpoint, LineError
from workers.process import make_runner, run_job


def _line(custom_id: str, body: dict) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body})


def test_parse_embedding_line() -> None:
    request = parse_line(_line("e1", {"input": ["a", "b"], "model": "m", "encoding_format": "base64"}), 1)
    assert request.endpoint is Endpoint.EMBEDDINGS and request.model == "m"
    assert request.options == {"input": ["a", "b"], "encoding_format": "base64"}
    assert parse_line(_line("e2", {"input": [1, 2, 3]}), 1).options["input"] == [[1, 2, 3]]


@pytest.mark.parametrize(("body", "words"), [
    ({"input": ""}, "body.input[0]: must not be empty"),
    ({"input": []}, "body.input: must be a non-empty"),
    ({"input": ["x"] * 2049}, "at most 2048"),
    ({"input": "x", "dimensions": 8}, "dimensions is not supported by batchinfer"),
    ({"input": "x", "encoding_format": "int8"}, "body.encoding_format"),
    ({}, "body.input: missing"),
])
def test_bad_embedding_lines(body: dict, words: str) -> None:
    with pytest.raises(LineError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_line(_line("bad", body), 1)


def test_embedding_matches_transformers(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path)
    engine = make_runner(model=str(tiny_llama), settings=settings, max_num_seqs=4, device="cpu",
                         dtype="float32").engine
    texts = ["hello world, this is a test", "short"]
    vectors, tokens = engine.embed(texts)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    reference = AutoModel.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    expected_tokens = 0
    for text, vector in zip(texts, vectors, strict=True):
        ids = tokenizer(text, return_tensors="pt").input_ids
        expected_tokens += ids.shape[1]
        with torch.no_grad():
            hidden = reference(ids).last_hidden_state[0].float().mean(dim=0)
        expected = torch.nn.functional.normalize(hidden, dim=0)
        torch.testing.assert_close(torch.tensor(vector), expected, atol=1e-4, rtol=0)
    assert tokens == expected_tokens
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == \
        engine.block_manager.num_total_blocks


def test_embedding_job_runs_locally(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, write_batch_size=4)
    sessions = session_factory(sqlite_url)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([
        _line("one", {"input": "hello there"}),
        _line("two", {"input": ["a", "b c"], "encoding_format": "base64"}),
        _line("long", {"input": [[5] * 5000]}),
        _line("empty", {"input": ""}),
    ]) + b"\n")
    with sessions() as session:
        job = submit_job(session, settings=settings, path=path, model=str(tiny_llama), owner="t")
    runner = make_runner(model=str(tiny_llama), settings=settings, max_num_seqs=4, device="cpu")
    run_job(job_id=job.id, runner=runner)
    with sessions() as session:
        job = get_job(session, job_id=job.id)
        assert job.request_counts == {"total": 4, "completed": 2, "failed": 2}
        lines = [orjson.loads(line) for line in export_results(session, job_id=job.id)]
        errors = [orjson.loads(line) for line in export_results(session, job_id=job.id, kind="errors")]
    assert [line["custom_id"] for line in lines] == ["one", "two"]
    for line in lines:
        read_output_line(line)
        body = line["response"]["body"]
        usage = body["usage"]
        assert body["object"] == "list" and usage["prompt_tokens"] == usage["total_tokens"] > 0
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    first = lines[0]["response"]["body"]["data"][0]["embedding"]
    assert abs(sum(x * x for x in first) - 1) < 1e-4
    packed = base64.b64decode(lines[1]["response"]["body"]["data"][1]["embedding"])
    assert len(struct.unpack(f"<{len(packed) // 4}f", packed)) == len(first)
    messages = {line["custom_id"]: line["error"]["message"] for line in errors}
    assert messages["long"].startswith("line 3: input[0]: 5000 tokens exceed the model's context")
    assert messages["empty"].startswith("line 4") and "body.input[0]: must not be empty" in messages["empty"]
