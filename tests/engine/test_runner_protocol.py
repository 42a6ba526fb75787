"""One runner protocol, implemented explicitly: embeddings on a tensor-parallel engine run on every rank
(the same vectors as one rank, the engine still in step afterwards), a pipeline engine refuses them at
once, and a tensor-parallel worker turns an embeddings line into its result instead of wedging."""

from __future__ import annotations

import threading
from pathlib import Path

import orjson
import pytest
import torch

from batchinfer.config import Settings
from batchinfer.engine import LLM, SamplingParams
from batchinfer.engine.parallel.distributed import tp_world_size
from batchinfer.engine.parallel.pp_runner import PipelineParallelRunner
from batchinfer.engine.parallel.tp_runner import TensorParallelRunner
from batchinfer.engine.worker.model_runner import ModelRunner
from batchinfer.engine.worker.runner_protocol import ModelRunnerProtocol

TEXTS = ["the cat reads a book", "a much longer sentence about the dog and the bird, read twice by the cat"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CPU = {"device": "cpu", "dtype": "float32"}


def _protocol_members() -> list[str]:
    return [name for name in vars(ModelRunnerProtocol) if not name.startswith("_")]


@pytest.mark.parametrize("runner_class", [TensorParallelRunner, PipelineParallelRunner])
def test_parallel_runners_implement_every_member_without_forwarding(runner_class: type) -> None:
    assert "__getattr__" not in vars(runner_class)
    assert {"embed", "execute_model", "close", "num_kv_blocks", "device"} <= set(_protocol_members())
    missing = [name for name in _protocol_members() if name not in vars(runner_class)]
    assert not missing, f"{runner_class.__name__} lacks {missing}"


def test_single_rank_runner_has_every_method() -> None:
    methods = [name for name in _protocol_members() if callable(getattr(ModelRunnerProtocol, name))]
    assert all(name in vars(ModelRunner) for name in methods)


def test_tp2_embeddings_run_on_every_rank_and_match_one_rank(tiny_llama: Path) -> None:
    with LLM(str(tiny_llama), **CPU) as single:
        expected, tokens = single.engine.embed(TEXTS)
        expected_text = single.generate(TEXTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(tiny_llama), tensor_parallel_size=2, **CPU) as parallel:
        got, got_tokens = parallel.engine.embed(TEXTS)
        # The ranks stayed in step: a generation after the embeddings equals one rank's.
        text = parallel.generate(TEXTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got_tokens == tokens
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
    assert text == expected_text
    assert tp_world_size() == 1


def _job_with_an_embeddings_line(sqlite_url: str, tmp_path: Path, tiny_llama: Path, *, chat_lines: int,
                                 **parallel: int) -> tuple:
    """(sessions, a submitted job of chat_lines chat lines and one embeddings line, a parallel runner)."""
    from batchinfer.store.db import session_factory, upgrade
    from batchinfer.store.jobs import submit_job
    from tests.workers.helpers import write_requests
    from workers.process import make_runner

    upgrade(sqlite_url)
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path)
    embedding = orjson.dumps({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings",
                              "body": {"input": TEXTS}})
    path = tmp_path / "in.jsonl"
    write_requests(path, chat_lines, extra_lines=[embedding])
    sessions = session_factory(sqlite_url)
    with sessions() as session:
        job = submit_job(session, settings=settings, path=path, model=str(tiny_llama), owner="t")
    runner = make_runner(model=str(tiny_llama), settings=settings, max_num_seqs=4, **parallel, **CPU)
    return sessions, job, runner


@pytest.mark.integration
def test_tp2_worker_answers_an_embeddings_line_beside_chat_lines(sqlite_url: str, tiny_llama: Path,
                                                                 tmp_path: Path) -> None:
    from batchinfer.store.export import export_results
    from batchinfer.store.jobs import get_job
    from workers.process import run_job

    sessions, job, runner = _job_with_an_embeddings_line(sqlite_url, tmp_path, tiny_llama, chat_lines=3,
                                                         tensor_parallel_size=2)
    done = threading.Event()
    try:
        worker = threading.Thread(target=lambda: (run_job(job_id=job.id, runner=runner), done.set()),
                                  daemon=True)
        worker.start()
        assert done.wait(120), "the tensor-parallel worker wedged on the embeddings line"
        expected, _ = runner.engine.embed(TEXTS)
    finally:
        runner.engine.close()
    with sessions() as session:
        assert get_job(session, job_id=job.id).request_counts == {"total": 4, "completed": 4, "failed": 0}
        lines = {line["custom_id"]: line
                 for line in map(orjson.loads, export_results(session, job_id=job.id))}
    vectors = [item["embedding"] for item in lines["emb"]["response"]["body"]["data"]]
    torch.testing.assert_close(torch.tensor(vectors), torch.tensor(expected), atol=1e-5, rtol=0)


def test_pipeline_engine_refuses_embeddings_at_once(tiny_llama: Path) -> None:
    with LLM(str(tiny_llama), pipeline_parallel_size=2, **CPU) as pipeline:
        with pytest.raises(ValueError, match=r"embeddings need pipeline_parallel_size=1"):
            pipeline.engine.embed(TEXTS)
        # Nothing reached the other stage: the pipeline still generates.
        assert pipeline.generate(TEXTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.integration
def test_pipeline_worker_errors_an_embeddings_line_and_runs_the_rest(sqlite_url: str, tiny_llama: Path,
                                                                     tmp_path: Path) -> None:
    from batchinfer.store.export import export_results
    from batchinfer.store.jobs import get_job
    from workers.process import run_job

    sessions, job, runner = _job_with_an_embeddings_line(sqlite_url, tmp_path, tiny_llama, chat_lines=2,
                                                         pipeline_parallel_size=2)
    try:
        run_job(job_id=job.id, runner=runner)
    finally:
        runner.engine.close()
    with sessions() as session:
        assert get_job(session, job_id=job.id).request_counts == {"total": 3, "completed": 2, "failed": 1}
        (error,) = map(orjson.loads, export_results(session, job_id=job.id, kind="errors"))
    assert error["custom_id"] == "emb"
    assert "embeddings need pipeline_parallel_size=1" in error["error"]["message"]
