"""Structured output through the engine on the tiny random models, and the sampler's grammar mask.

The tiny models' weights are random, so their tokens are noise: the grammar alone makes the output valid.
Seeded sampling keeps them moving (a random greedy model tends to repeat one whitespace token), and the
schemas' smallest valid outputs are short, so every request reaches the grammar's end well within
max_tokens; truncation ("length") is asserted on its own.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

from batchinfer.engine import SamplingParams
from batchinfer.engine.core.sequence import Sequence, SequenceStatus
from batchinfer.engine.sampling.sampler import GrammarMask, Sampler
from batchinfer.engine.sampling.structured import GrammarBackend, GrammarState, sync
from batchinfer.engine.sampling_params import StructuredOutputsParams
from tests.fixtures.tiny_models import build_tokenizer

# Mixed schemas: enums, nested objects, arrays with min/max items, numbers with ranges, required fields,
# additionalProperties false, optional fields, anyOf, a top-level array. (Strings are bounded by ASCII
# patterns: random byte tokens can spell invalid UTF-8, which decodes longer than the grammar counted.)
SCHEMAS: dict[str, dict] = {
    "enum_range_bool": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"}}, "required": ["color", "n", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 1000},
            "role": {"enum": ["admin", "guest"]}}, "required": ["id", "role"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "array_bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "number_ranges": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["score", "count"], "additionalProperties": False},
    "patterned_strings": {"type": "object", "properties": {
        "kind": {"const": "point"}, "label": {"type": "string", "pattern": "^[a-z0-9 ]{1,6}$"},
        "x": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["kind", "label", "x"],
        "additionalProperties": False},
    "optional_and_anyof": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "string", "pattern": "^[A-Z]{0,3}$"},
        "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
        "required": ["a", "v"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {
        "pairs": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "object", "properties": {
            "k": {"enum": ["x", "y"]}}, "required": ["k"], "additionalProperties": False}}},
        "required": ["pairs"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
                        "minItems": 1, "maxItems": 4},
}  # fmt: skip
NAMES = list(SCHEMAS)
MAX_TOKENS = 450  # a tiny model's context is 512; these outputs take up to ~200 tokens with free whitespace


def schema_params(i: int, *, compact: bool | None = None, **overrides) -> SamplingParams:
    """Request i of the mixed batch: schema i mod 8, seeded; free whitespace in every other round of 8
    (compact: never / always)."""
    compact = (i // len(NAMES)) % 2 == 1 if compact is None else compact
    constraint = StructuredOutputsParams(json=SCHEMAS[NAMES[i % len(NAMES)]], disable_any_whitespace=compact)
    fields = {"temperature": 1.0, "seed": i, "max_tokens": MAX_TOKENS, "structured_outputs": constraint}
    return SamplingParams(**{**fields, **overrides})


def assert_valid(output, schema: dict) -> None:
    """The completion ended at the grammar's end and its text is JSON matching the schema."""
    assert output.finish_reason == "stop", (output.finish_reason, output.text)
    jsonschema.validate(json.loads(output.text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_64_requests_over_mixed_schemas_all_parse_and_validate(request, make_llm, model: str) -> None:
    llm = make_llm(request.getfixturevalue(model))
    outputs = llm.generate([f"the cat reads {i}" for i in range(64)], [schema_params(i) for i in range(64)])
    for i, output in enumerate(outputs):
        assert_valid(output.outputs[0], SCHEMAS[NAMES[i % len(NAMES)]])
        assert output.outputs[0].token_ids[-1] in llm.engine.eos_token_ids  # the grammar's end is EOS
    backend = llm.engine.grammar_backend
    assert backend.num_compiled == 2 * len(SCHEMAS)  # once per distinct (schema, whitespace) pair


def test_json_object_mode_gives_objects_and_truncation_says_length(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    json_object = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    outputs = llm.generate(["a dog sends"] * 24, [
        SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=json_object)
        for i in range(24)])
    finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    truncated = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "length"]
    assert finished and len(finished) + len(truncated) == 24
    for output in finished:
        assert isinstance(json.loads(output.text), dict)
    for output in truncated:  # a random model rarely closes a key it opened: cut off mid-object
        assert len(output.token_ids) == 60 and output.text.startswith("{")
        with pytest.raises(json.JSONDecodeError):
            json.loads(output.text)
    # max_tokens reached mid-object is "length" for a schema too.
    short = llm.generate(["a dog sends"], schema_params(1, max_tokens=3))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_guided_choice_and_regex(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    choices = ["yes", "no", "maybe so", 'say "hi"']
    regex = r"\d{3}-[a-z]{2,4}( [A-Z]{1,3})?"
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, structured_outputs={"choice": choices})
              for i, t in enumerate([0.0, 1.0, 1.0, 1.0, 1.0, 1.0])]
    params += [SamplingParams(temperature=t, seed=i, max_tokens=40, structured_outputs={"regex": regex})
               for i, t in enumerate([0.0, 1.0, 1.0, 1.0, 1.0, 1.0])]
    outputs = llm.generate([f"our server counts {i}" for i in range(12)], params)
    for output in outputs[:6]:
        assert output.outputs[0].text in choices and output.outputs[0].finish_reason == "stop"
    for output in outputs[6:]:
        assert re.fullmatch(regex, output.outputs[0].text), output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"


def test_unconstrained_rows_are_token_identical_beside_constrained_rows(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2 else
            SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
            for i in range(16)]
    prompts = [f"the queue sorts {i} blocks of memory" for i in range(16)]
    alone = llm.generate(prompts, free)
    mixed_prompts, mixed_params = [], []
    for i in range(16):
        mixed_prompts += [prompts[i], f"a worker caches {i}"]
        mixed_params += [free[i], schema_params(i, temperature=0.0 if i % 3 == 0 else 1.0)]
    mixed = llm.generate(mixed_prompts, mixed_params)
    for i in range(16):
        assert mixed[2 * i].outputs[0].token_ids == alone[i].outputs[0].token_ids
        assert_valid(mixed[2 * i + 1].outputs[0], SCHEMAS[NAMES[i % len(NAMES)]])


def test_n_completions_with_a_seed_are_each_constrained(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    schema = SCHEMAS["enum_range_bool"]
    family = llm.generate(["my friend answers"], schema_params(0, n=4, seed=7))[0]
    assert [c.index for c in family.outputs] == [0, 1, 2, 3]
    for completion in family.outputs:
        assert_valid(completion, schema)
    assert len({c.text for c in family.outputs}) > 1  # each child has its own seed and its own matcher
    again = llm.generate(["my friend answers"], schema_params(0, n=4, seed=7))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in family.outputs]


def test_preempted_sequences_keep_their_grammar_state(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, num_kv_blocks=24, block_size=8)  # 192 slots for 16 growing sequences
    outputs = llm.generate([f"the model writes {i} every night" for i in range(16)],
                           [schema_params(i, compact=True, max_tokens=150) for i in range(16)])
    assert llm.engine.get_stats().num_preemptions > 0
    for i, output in enumerate(outputs):
        assert_valid(output.outputs[0], SCHEMAS[NAMES[i % len(NAMES)]])


def test_grammar_compiles_off_the_step_and_the_request_waits_outside_the_scheduler(tiny_llama, make_llm):
    llm = make_llm(tiny_llama)
    engine = llm.engine
    engine.add_request("warm", "x", SamplingParams(max_tokens=1, structured_outputs={"regex": "a"}))
    while engine.has_unfinished():
        engine.step()
    release = threading.Event()
    compile_now = engine.grammar_backend._compile
    engine.grammar_backend._compile = lambda constraint: (release.wait(30), compile_now(constraint))[1]
    schema = SCHEMAS["nested"]
    engine.add_request("slow", "the gpu", schema_params(0, structured_outputs={"json": schema}))
    engine.add_request("doomed", "the gpu", schema_params(2, structured_outputs={"json": schema}))
    engine.add_request("free", "the gpu", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finished = {}
    for _ in range(12):  # the free request runs to its end while the grammar is held
        finished.update({o.request_id: o for o in engine.step()})
    assert "free" in finished and engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == 0
    assert engine.abort("doomed").outputs[0].finish_reason == "abort"  # never reached the scheduler
    release.set()
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step()})
    assert_valid(finished["slow"].outputs[0], schema)


def test_a_grammar_that_fails_to_compile_ends_its_request_alone(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.engine
    unchecked = SamplingParams.from_dict({"max_tokens": 8, "structured_outputs": {"regex": "(ab"}})
    backend = engine.structured.grammars()
    release = threading.Event()
    compile_now = backend._compile
    backend._compile = lambda constraint: (release.wait(30), compile_now(constraint))[1]
    engine.add_request("bad", "the cat", unchecked)  # skipped the checks (from_dict): fails in the thread
    engine.add_request("good", "the dog", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    release.set()
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step()})
    assert finished["bad"].outputs[0].finish_reason == "abort" and finished["bad"].outputs[0].token_ids == []
    assert len(finished["good"].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="structured_outputs: .*parenthesis"):  # known bad: refused at once
        engine.add_request("again", "the cat", unchecked)


def padded_vocab_model(directory: Path, extra: int) -> Path:
    """A tiny Llama whose embedding and head have `extra` rows past the tokenizer (a padded vocab)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=len(tokenizer) + extra, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # the padded ids get the largest logits the head can give
        model.lm_head.weight[len(tokenizer):] = model.lm_head.weight[: len(tokenizer)].abs().max() * 4
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def test_padded_vocabulary_is_masked_past_the_tokenizer(tmp_path, make_llm) -> None:
    llm = make_llm(padded_vocab_model(tmp_path / "padded", extra=37))
    tokenizer_size = len(llm.get_tokenizer())
    assert llm.engine.vocab_size == tokenizer_size + 37
    free = llm.generate(["the cat"], SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True))
    assert max(free[0].outputs[0].token_ids) >= tokenizer_size  # unmasked, the padded ids do come up
    outputs = llm.generate(["the cat"] * 8, [schema_params(i, compact=True) for i in range(8)])
    for i, output in enumerate(outputs):
        assert_valid(output.outputs[0], SCHEMAS[NAMES[i % len(NAMES)]])
        assert max(output.outputs[0].token_ids) < tokenizer_size
    assert llm.engine.grammar_backend.bitmask.shape[1] == -(-(tokenizer_size + 37) // 32)


# --- the sampler's mask and the matcher's bookkeeping, without a model ---------------------------------

VOCAB = 70  # not a multiple of 32: the last bitmask word is partial


def test_sampler_masks_only_the_constrained_rows() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=1.0, seed=5, logprobs=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=6)]
    seqs = [Sequence("r", [1, 2], p, max_tokens=8) for p in params]
    plain = Sampler(seed=0)(logits, seqs, {0})
    allowed = [3, 40, 69]
    bitmask = torch.zeros(8, 3, dtype=torch.int32)
    for row in (1, 2):
        for token in allowed:
            bitmask[row, token // 32] |= 1 << (token % 32)
    original = logits.clone()
    seqs = [Sequence("r", [1, 2], p, max_tokens=8) for p in params]  # fresh seeded generators
    masked = Sampler(seed=0)(logits, seqs, {0}, GrammarMask(bitmask, [1, 2]))
    assert torch.equal(logits[[0, 3]], original[[0, 3]])  # only the constrained rows are masked, in place
    assert torch.isinf(logits[1]).sum() == VOCAB - len(allowed)
    assert masked.token_ids[1] in allowed and masked.token_ids[2] in allowed
    assert masked.token_ids[2] == max(allowed, key=lambda t: original[2, t].item())
    for row in (0, 3):  # unconstrained rows: the same tokens and the same logprobs, bit for bit
        assert masked.token_ids[row] == plain.token_ids[row]
    assert masked.logprobs[0] == plain.logprobs[0]
    assert set(masked.logprobs[1].top_token_ids) <= set(allowed)  # logprobs of the allowed tokens only


def test_sync_rolls_back_and_replays_to_the_sequence_output() -> None:
    tokenizer = build_tokenizer()
    backend = GrammarBackend(tokenizer, vocab_size=len(tokenizer), eos_token_ids={tokenizer.eos_token_id},
                             max_num_seqs=4)
    try:
        constraint = StructuredOutputsParams(regex="[a-z]+")
        state = GrammarState(backend.compile(constraint))
        backend.start(state)
        tokens = [tokenizer.convert_tokens_to_ids(c) for c in "abc"]
        for token in tokens:
            assert backend.accept(state, token)
        sync(state, tokens[:1])  # e.g. a recompute that kept only the first token
        assert state.num_accepted == 1 and backend.accept(state, tokens[1])
        sync(state, tokens)  # replay the missing one
        assert state.num_accepted == 3
        sync(state, [])
        assert state.num_accepted == 0 and not state.matcher.is_completed()
        assert not backend.accept(state, tokenizer.convert_tokens_to_ids("{"))  # outside the regex
        assert backend.compile(dataclasses.replace(constraint)) is state.compiled  # compiled once
    finally:
        backend.close()


def test_finished_status_is_stop_at_the_grammar_end(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    out = llm.generate(["the cat"], SamplingParams(temperature=0.0, max_tokens=20,
                                                    structured_outputs={"choice": ["ok"]}))[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"
    assert SequenceStatus.FINISHED_STOPPED.finish_reason == "stop"
