"""`batchinfer run` nights on one data dir (issue 31): night 2 computes only its changed lines, a night
whose lines are all hits loads no model, `--result-cache off` computes everything, `status` prints hits;
a schedule's jobs take its `--result-cache`."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from tests.cli.helpers import cli, tiny_model_env
from tests.workers.helpers import read_lines


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return tiny_model_env(monkeypatch, tmp_path, tiny_llama)


def _write(path: Path, prompts: list[str]) -> None:
    with path.open("wb") as out:  # half greedy, half seeded sampling
        for i, prompt in enumerate(prompts):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
                    **({"temperature": 0.9, "seed": i} if i % 2 else {"temperature": 0})}
            out.write(orjson.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + b"\n")


def _choices(path: Path) -> list:
    return [line["response"]["body"]["choices"] for line in read_lines(path)]


def _no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails from now on: a run that succeeds loaded none."""
    import workers.process

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("no model may be loaded here")

    monkeypatch.setattr(workers.process, "build_engine", refuse)


def test_nights_on_one_data_dir(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [f"describe product {i}" for i in range(20)]
    _write(env / "night1.jsonl", prompts)
    code, out = cli("run", str(env / "night1.jsonl"), "-o", str(env / "out1.jsonl"))
    assert code == 0, out
    _write(env / "night2.jsonl", [p + " v2" if i in (4, 9) else p for i, p in enumerate(prompts)])
    code, out = cli("run", str(env / "night2.jsonl"), "-o", str(env / "out2.jsonl"), "--json")
    assert code == 0, out
    night2 = orjson.loads(out.strip().splitlines()[-1])
    assert night2["result_cache"] == {"mode": "use", "hits": 18, "dedups": 0}
    first, second = _choices(env / "out1.jsonl"), _choices(env / "out2.jsonl")
    assert [b for i, b in enumerate(second) if i not in (4, 9)] == [b for i, b in enumerate(first)
                                                                   if i not in (4, 9)]
    lines = read_lines(env / "out2.jsonl")
    assert [line["provenance"]["result_cache"] for line in lines].count("miss") == 2

    _no_engine(monkeypatch)  # night 3 repeats night 2: every line a hit, no model loaded
    code, out = cli("run", str(env / "night2.jsonl"), "-o", str(env / "out3.jsonl"))
    assert code == 0, out
    assert "20 from the result cache" in out
    assert _choices(env / "out3.jsonl") == second
    batch_id = re.findall(r"batch_\d+", out)[-1]
    code, out = cli("status", batch_id)
    assert code == 0 and "20 from the result cache, 0 copied from identical lines" in out

    code, out = cli("run", str(env / "night2.jsonl"), "-o", str(env / "out4.jsonl"), "--result-cache", "off")
    assert code == 4, out  # off needs the engine, which cannot load here: the job fails, saying why
    assert "no model may be loaded here" in out


def test_schedule_jobs_take_the_schedules_result_cache_mode(env: Path) -> None:
    _write(env / "in.jsonl", ["a", "b"])
    code, out = cli("schedule", "add", "nightly", "--cron", "0 2 * * *", "--input", str(env / "in.jsonl"),
                     "--result-cache", "off", "--json")
    assert code == 0, out
    assert orjson.loads(out)["result_cache"] == "off"
    code, out = cli("schedule", "run-now", "nightly", "--json")
    assert code == 0, out
    code, out = cli("list", "--json")
    batches = [orjson.loads(line) for line in out.splitlines()]
    assert [batch["result_cache"]["mode"] for batch in batches] == ["off"]
