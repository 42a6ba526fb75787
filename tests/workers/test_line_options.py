"""Issue 18's line fields through a worker: echo prepends the prompt, add_generation_prompt and
chat_template_kwargs reach the chat template, logit_bias reaches the sampler, body.model routes the line,
and a /v1/responses line runs as chat."""

from __future__ import annotations

import io
from pathlib import Path

import orjson

from batchinfer.config import Settings
from batchinfer.store.db import session_factory, upgrade
from batchinfer.store.export import export_results
from batchinfer.store.jobs import submit_job
from batchinfer.wire.output_line import read_output_line
from workers.process import make_runner, run_job

USER = [{"role": "user", "content": "the cat sat"}]


def _run(url: str, tmp_path: Path, model: Path, lines: list[dict], template: str | None = None,
         job_model: str | None = None) -> dict:
    upgrade(url)
    settings = Settings(database_url=url, data_dir=tmp_path)
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    with session_factory(url)() as session:
        job = submit_job(session, settings=settings, stream=io.BytesIO(data), model=job_model or str(model))
    runner = make_runner(model=str(model), settings=settings, device="cpu", kv_cache_memory_bytes=16 << 20)
    if template is not None:
        runner.engine.tokenizer.chat_template = template
    if job_model is None:
        run_job(job_id=job.id, runner=runner)
    else:  # as a worker does: claim the shards of the runner's model, of any job
        runner.work()
    with session_factory(url)() as session:
        out = {line["custom_id"]: line for line in map(orjson.loads, export_results(session, job_id=job.id))}
        errors = list(map(orjson.loads, export_results(session, job_id=job.id, kind="errors")))
    assert errors == []
    return {custom_id: line["response"]["body"] for custom_id, line in out.items()}


def test_echo_and_logit_bias_on_completions(sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    base = {"prompt": "the cat sat on", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    bodies = _run(sqlite_url, tmp_path, tiny_llama, [
        {"custom_id": "plain", **base}, {"custom_id": "echo", **base, "echo": True},
        {"custom_id": "bias", **base, "logit_bias": {"9": 100}},
    ])
    plain, echo = bodies["plain"]["choices"][0]["text"], bodies["echo"]["choices"][0]["text"]
    assert echo == "the cat sat on" + plain
    assert bodies["echo"]["usage"] == bodies["plain"]["usage"]  # echo does not count as generated tokens
    assert bodies["bias"]["usage"]["completion_tokens"] == 4
    assert bodies["bias"]["choices"][0]["text"] != plain


def test_chat_template_options_reach_the_template(sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if style %}{{ style }}\n{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")
    base = {"messages": USER, "max_tokens": 2, "temperature": 0}
    bodies = _run(sqlite_url, tmp_path, tiny_llama, [
        {"custom_id": "default", **base},
        {"custom_id": "no-gen", **base, "add_generation_prompt": False},
        {"custom_id": "styled", **base, "chat_template_kwargs": {"style": "answer in verse please"}},
    ], template=template)
    tokens = {custom_id: body["usage"]["prompt_tokens"] for custom_id, body in bodies.items()}
    assert tokens["no-gen"] < tokens["default"] < tokens["styled"]


def test_a_line_model_runs_on_a_worker_of_that_model(sqlite_url: str, tmp_path: Path,
                                                     tiny_llama: Path) -> None:
    line = {"prompt": "the cat", "max_tokens": 2}
    bodies = _run(sqlite_url, tmp_path, tiny_llama, [
        {"custom_id": "routed", **line, "model": str(tiny_llama)}, {"custom_id": "default", **line},
    ], job_model="the-default-model")
    assert list(bodies) == ["routed"]  # the default model's line waits for a worker of that model
    assert bodies["routed"]["model"] == str(tiny_llama)


def test_a_responses_line_runs_as_chat(sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."}, *USER], "max_tokens": 3,
            "temperature": 0}
    responses = {"input": "the cat sat", "instructions": "Be brief.", "max_output_tokens": 3,
                 "temperature": 0}
    bodies = _run(sqlite_url, tmp_path, tiny_llama, [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "resp", "method": "POST", "url": "/v1/responses", "body": responses},
    ])
    response, completion = bodies["resp"], bodies["chat"]
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["output"][0]["content"][0]["text"] == completion["choices"][0]["message"]["content"]
    assert response["usage"]["input_tokens"] == completion["usage"]["prompt_tokens"]
    assert response["usage"]["output_tokens"] == completion["usage"]["completion_tokens"] == 3
    read_output_line({"id": "x", "custom_id": "resp", "error": None,
                                    "response": {"status_code": 200, "request_id": "r", "body": response}})


def test_prompt_logprobs_come_back_where_vllm_puts_them(sqlite_url: str, tmp_path: Path,
                                                        tiny_llama: Path) -> None:
    base = {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    bodies = _run(sqlite_url, tmp_path, tiny_llama, [
        {"custom_id": "text", "prompt": "the cat sat on the mat", **base},
        {"custom_id": "chat", "messages": USER, **base},
        {"custom_id": "plain", "prompt": "the cat sat on the mat", "max_tokens": 2},
    ])
    text, chat = bodies["text"], bodies["chat"]
    for entries, body in ((text["choices"][0]["prompt_logprobs"], text), (chat["prompt_logprobs"], chat)):
        assert len(entries) == body["usage"]["prompt_tokens"] and entries[0] is None
        for entry in entries[1:]:
            assert 2 <= len(entry) <= 3  # the prompt token, plus the top 2
            for token_id, figure in entry.items():
                assert int(token_id) >= 0 and figure["logprob"] <= 0 and figure["rank"] >= 1
                assert isinstance(figure["decoded_token"], str)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        read_output_line({"id": "x", "custom_id": "c", "error": None,
                                        "response": {"status_code": 200, "request_id": "r", "body": body}})
    assert "prompt_logprobs" not in bodies["plain"] and "prompt_logprobs" not in bodies["plain"]["choices"][0]


def test_completions_logprobs_carry_text_offset_like_openais_legacy_completions(
        sqlite_url: str, tmp_path: Path, tiny_llama: Path) -> None:
    base = {"prompt": "the cat sat on", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    bodies = _run(sqlite_url, tmp_path, tiny_llama, [{"custom_id": "plain", **base},
                                                     {"custom_id": "echo", **base, "echo": True}])
    for custom_id, start in (("plain", 0), ("echo", len("the cat sat on"))):
        logprobs = bodies[custom_id]["choices"][0]["logprobs"]
        tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
        assert len(offsets) == len(tokens) == len(logprobs["token_logprobs"]) == 4
        # each token starts where the ones before it end, the first where the generated text begins
        assert offsets == [start + len("".join(tokens[:i])) for i in range(len(tokens))], custom_id
