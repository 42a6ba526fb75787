"""The held-out scenario of issue 33: `batchinfer run FILE -o OUT --lora-modules a1=DIR --lora-modules a2=DIR`
on a tiny random Llama in fp32, a 30-line job mixing base lines and lines for each adapter (body.model =
NAME): greedy outputs equal transformers' greedy outputs of the base with that adapter merged, and the
adapters change the outputs. An unknown name is model_not_found listing the served names.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from tests.fixtures.tiny_lora import MergedReference, build_lora_adapter
from tests.fixtures.tiny_models import training_sentences
from tests.workers.helpers import read_lines

MAX_TOKENS = 6


@pytest.fixture
def env(tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHINFER_DEFAULT_MODEL", str(tiny_llama))
    monkeypatch.setenv("BATCHINFER_DEVICE", "cpu")
    monkeypatch.setenv("BATCHINFER_DTYPE", "float32")
    monkeypatch.setenv("BATCHINFER_KV_CACHE_MEMORY_BYTES", str(16 << 20))
    return tmp_path


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_lora")
    return {name: build_lora_adapter(tiny_llama, root / name, seed=seed) for name, seed in (("a1", 11),
                                                                                          ("a2", 12))}


def _write_job(path: Path, model: str) -> list[tuple[str, str | None, str]]:
    """30 completion lines: base lines (no model, or the model's own name) and lines for a1 and a2."""
    names = [None, "a1", "a2", model, "a1", "a2"]
    lines = []
    with path.open("wb") as out:
        for i, prompt in enumerate(training_sentences(30, seed=21)):
            custom_id, name = f"line-{i:02d}", names[i % len(names)]
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            if name is not None:
                body["model"] = name
            out.write(orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                                    "body": body}) + b"\n")
            lines.append((custom_id, None if name == model else name, prompt))
    return lines


def test_run_mixing_base_and_two_adapters_equals_merged_models(env: Path, tiny_llama: Path, adapters) -> None:
    lines = _write_job(env / "job.jsonl", str(tiny_llama))
    result = CliRunner().invoke(main, [
        "run", str(env / "job.jsonl"), "-o", str(env / "out.jsonl"),
        "--lora-modules", f"a1={adapters['a1']}", "--lora-modules", f"a2={adapters['a2']}"],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = {line["custom_id"]: line for line in read_lines(env / "out.jsonl")}
    assert len(out) == 30
    reference = MergedReference(tiny_llama)
    changed = 0
    for custom_id, name, prompt in lines:
        body = out[custom_id]["response"]["body"]
        assert body["model"] == (name or str(tiny_llama))
        adapter = None if name is None else adapters[name]
        expected = reference.completion(adapter, prompt, MAX_TOKENS)
        ours = body["choices"][0]["text"].rstrip("\ufffd"), body["usage"]["completion_tokens"]
        assert ours == expected, (custom_id, name)
        if name is not None:
            changed += expected != reference.completion(None, prompt, MAX_TOKENS)
    assert changed >= 12, "the adapters should change most of their 20 lines' outputs"


def test_unknown_adapter_name_is_model_not_found_listing_served_names(env: Path, tiny_llama: Path,
                                                                     adapters) -> None:
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "the cat", "max_tokens": 2, "model": "a2"}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "the cat", "max_tokens": 2, "model": "a3"}}]
    (env / "job.jsonl").write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    result = CliRunner().invoke(main, [  # several NAME=PATH after one flag, as vLLM's nargs='+'
        "run", str(env / "job.jsonl"), "-o", str(env / "out.jsonl"),
        "--lora-modules", f"a1={adapters['a1']}", f"a2={adapters['a2']}"], catch_exceptions=False)
    assert result.exit_code == 3, result.output
    assert [line["custom_id"] for line in read_lines(env / "out.jsonl")] == ["ok"]
    (error,) = read_lines(env / "out.errors.jsonl")
    assert error["custom_id"] == "bad" and error["error"]["code"] == "model_not_found"
    assert f"served models: {tiny_llama}, a1, a2 (" in error["error"]["message"]


def test_bad_lora_flags_fail_before_the_job(env: Path, tiny_llama: Path, adapters, tmp_path: Path) -> None:
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi", "max_tokens": 1}}
    (env / "job.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    cases = [(["--lora-modules", "a1"], "is not NAME=PATH"),
             (["--lora-modules", f"a1={tmp_path / 'nowhere'}"], "is not a directory"),
             (["--lora-modules", f"a1={adapters['a1']}", "--max-lora-rank", "4"],
              "rank 8 exceeds max_lora_rank=4")]
    for flags, message in cases:
        result = CliRunner().invoke(main, ["run", str(env / "job.jsonl"), "-o", str(env / "o.jsonl"), *flags])
        assert message in result.output, (flags, result.output)


def test_an_adapter_named_like_the_model_is_refused(env: Path, tiny_llama: Path, adapters) -> None:
    (env / "job.jsonl").write_bytes(b'{"custom_id": "x", "body": {"prompt": "hi", "max_tokens": 1}}\n')
    flags = ["--served-model-name", "tiny", "--lora-modules", f"tiny={adapters['a1']}"]
    result = CliRunner().invoke(main, ["run", str(env / "job.jsonl"), "-o", str(env / "o.jsonl"), *flags])
    assert result.exit_code == 1 and "'tiny' is already the model's name" in result.output
