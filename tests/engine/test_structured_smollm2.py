"""Structured output on the real SmolLM2-135M-Instruct: a mixed batch of schemas, JSON objects, choices,
regexes and free requests, all in one engine; every constrained output parses and validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from batchinfer.engine import LLM, SamplingParams
from batchinfer.engine.sampling_params import StructuredOutputsParams
from tests.engine.test_structured_engine import SCHEMAS as TINY_SCHEMAS

pytestmark = pytest.mark.slow

# A real model keeps to UTF-8, so free strings with length bounds are fair here.
SCHEMAS = {**TINY_SCHEMAS, "bounded_strings": {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 20}, "city": {"type": "string", "maxLength": 30}},
    "required": ["name", "city"], "additionalProperties": False}}  # fmt: skip
NAMES = list(SCHEMAS)
FREE_QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What does a CPU do?",
                  "Give me a synonym for 'happy'."]
SENTIMENTS = ["positive", "negative", "neutral"]
REVIEWS = ["I loved this film, wonderful!", "Terrible service, never again.", "It was fine, I guess.",
           "Best purchase I ever made."]
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


@pytest.fixture(scope="module")
def llm(smollm2):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: more threads only contend
    with LLM(str(smollm2), device="cpu", dtype="float32", max_model_len=1024, num_kv_blocks=512) as llm:
        yield llm
    torch.set_num_threads(threads)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_a_mixed_batch_is_valid_and_free_requests_are_untouched(llm) -> None:
    conversations, params, expect = [], [], []
    for i in range(64):
        name = NAMES[i % len(NAMES)]
        conversations.append(user(f"Reply with JSON matching this schema: {json.dumps(SCHEMAS[name])}. "
                                  f"Example {i}."))
        params.append(SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=200,
                                     structured_outputs=StructuredOutputsParams(json=SCHEMAS[name])))
        expect.append(("schema", SCHEMAS[name]))
    for i in range(8):
        conversations.append(user(f"Return a JSON object with the keys name and age for person {i}."))
        params.append(SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=200,
                                     structured_outputs={"json_object": True}))
        expect.append(("object", None))
    for i, review in enumerate(REVIEWS):
        conversations.append(user(f"Classify the sentiment of this review: {review}"))
        params.append(SamplingParams(temperature=0.0, seed=i, max_tokens=10,
                                     structured_outputs={"choice": SENTIMENTS}))
        expect.append(("choice", None))
        conversations.append(user(f"Give a date in ISO format for event number {i}."))
        params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=20,
                                     structured_outputs={"regex": DATE}))
        expect.append(("regex", None))
    free = SamplingParams(temperature=0.0, max_tokens=32)
    conversations += [user(q) for q in FREE_QUESTIONS]
    params += [free] * len(FREE_QUESTIONS)

    outputs = llm.chat(conversations, params)
    formats = jsonschema.FormatChecker()
    for output, (kind, schema) in zip(outputs, expect, strict=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (kind, completion.text)
        if kind == "schema":
            jsonschema.validate(json.loads(completion.text), schema, format_checker=formats)
        elif kind == "object":
            assert isinstance(json.loads(completion.text), dict)
        elif kind == "choice":
            assert completion.text in SENTIMENTS
        else:
            assert re.fullmatch(DATE, completion.text), completion.text
    alone = llm.chat([user(q) for q in FREE_QUESTIONS], free)
    for mixed, single in zip(outputs[-len(FREE_QUESTIONS):], alone, strict=True):
        assert mixed.outputs[0].token_ids == single.outputs[0].token_ids
    assert llm.engine.grammar_backend.num_compiled == len(SCHEMAS) + 3  # + json_object, choice, regex
