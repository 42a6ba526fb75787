"""Prefix-cache isolation by owner (issue 15): another owner's right guess of a system prompt gets no
cached tokens, the owner's own repeated prefix still hits, and prefix_cache_scope="global" shares."""

from __future__ import annotations

from pathlib import Path

import orjson

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import submit_job
from workers.process import make_runner, run_job

# About 300 tokens of the tiny tokenizer's own vocabulary: a system prompt worth guessing.
SYSTEM = " ".join(f"The cat reads the prompt number {i} and the worker caches blocks of memory."
                  for i in range(20))


def _write(path: Path, count: int) -> None:
    with path.open("wb") as out:
        for i in range(count):
            body = {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"a dog sends every request {i}"}],
                    "max_tokens": 2, "temperature": 0}
            out.write(orjson.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + b"\n")


def _cached(runner, sessions, settings: Settings, path: Path, owner: str) -> list[int]:
    """Submit the file as `owner`, run it, and return each line's cached_tokens."""
    with sessions() as session:
        # The result cache off: a hit would return the first run's usage, and this is about prefix blocks.
        job = submit_job(session, settings=settings, path=path, model=runner.model, owner=owner,
                         result_cache="off")
    run_job(job_id=job.id, runner=runner)
    with sessions() as session:
        lines = [orjson.loads(line) for line in export_results(session, job_id=job.id)]
    return [line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in lines]


def _shared_prefix_tokens(runner) -> int:
    """Tokens the requests of _write have in common (the templated system prompt and what follows)."""
    tokenizer = runner.engine.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": f"a dog sends every request {i}"}],
                                           add_generation_prompt=True, tokenize=False) for i in (0, 1)]
    ids = [runner.engine.tokenize(text, add_special_tokens=False) for text in texts]
    shared = 0
    while ids[0][shared] == ids[1][shared]:
        shared += 1
    return shared


def _setup(url: str, tmp_path: Path, tiny_llama: Path, scope: str):
    upgrade(url)
    settings = Settings(database_url=url, data_dir=tmp_path, prefix_cache_scope=scope)
    runner = make_runner(model=str(tiny_llama), settings=settings, max_num_seqs=4, device="cpu")
    path = tmp_path / "in.jsonl"
    _write(path, 4)
    return settings, runner, session_factory(url), path


def test_other_owner_gets_no_cached_tokens(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    settings, runner, sessions, path = _setup(sqlite_url, tmp_path, tiny_llama, "owner")
    shared = _shared_prefix_tokens(runner)
    assert shared > 200
    first = _cached(runner, sessions, settings, path, "alice")
    assert max(first) > 0  # alice's own requests share her prefix within the job
    guess = tmp_path / "guess.jsonl"
    _write(guess, 1)
    assert _cached(runner, sessions, settings, guess, "bob") == [0]  # the right guess learns nothing
    again = _cached(runner, sessions, settings, path, "alice")
    assert min(again) >= 0.9 * shared, (again, shared)  # her repeated prefix still hits


def test_global_scope_shares_across_owners(sqlite_url: str, tiny_llama: Path, tmp_path: Path) -> None:
    settings, runner, sessions, path = _setup(sqlite_url, tmp_path, tiny_llama, "global")
    shared = _shared_prefix_tokens(runner)
    _cached(runner, sessions, settings, path, "alice")
    guess = tmp_path / "guess.jsonl"
    _write(guess, 1)
    assert _cached(runner, sessions, settings, guess, "bob")[0] >= 0.9 * shared
