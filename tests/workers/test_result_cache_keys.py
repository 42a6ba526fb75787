"""The result-cache key (workers/result_cache.py): changing any single field that decides an output gives
another key (one case per field, so dropping a field from the key fails its case); only deterministic
requests have a key; the model fingerprint (workers/model_identity.py) follows the model's files and is
cached on disk."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.sampling_params import _DEFAULTS, SamplingParams
from batchinfer.store.shards import PendingRequest
from workers import model_identity
from workers.model_identity import ModelIdentity, fingerprint_dir
from workers.result_cache import request_key

IDENTITY = ModelIdentity(model="m", model_fingerprint="f" * 64, dtype="float32", quantization=None)
MESSAGES = [{"role": "user", "content": "hello"}]
BASE_PARAMS: dict[str, Any] = {"temperature": 0.8, "seed": 1, "max_tokens": 8}


def _request(*, endpoint: str = "chat", messages: Any = MESSAGES, prompt: Any = None,
             options: dict | None = None, **params: Any) -> PendingRequest:
    return PendingRequest(1, "c", 1, endpoint, messages, prompt, SamplingParams(**{**BASE_PARAMS, **params}),
                          options)


def _key(identity: ModelIdentity = IDENTITY, scope: str = "owner:a", **request: Any) -> str | None:
    return request_key(identity, _request(**request), scope=scope)


# One changed value per sampling and output field (every field of SamplingParams has a case: see below).
SAMPLING_CHANGES: dict[str, Any] = {
    "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
    "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 2, "stop": ["x"],
    "stop_token_ids": [7], "include_stop_str_in_output": True, "ignore_eos": True, "max_tokens": 9,
    "min_tokens": 1, "logprobs": 2, "prompt_logprobs": 1, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "bad_words": ["bad"], "allowed_token_ids": [1, 2, 3],
    "logit_bias": {5: 1.0}, "truncate_prompt_tokens": 4,
    "structured_outputs": {"regex": "[a-z]+"}, "speculative_decoding": False,
}
IDENTITY_CHANGES: dict[str, Any] = {
    "model": "other-name", "model_fingerprint": "e" * 64, "dtype": "bfloat16", "quantization": "int8",
    "adapter": "sql-lora", "adapter_fingerprint": "d" * 64, "kv_cache_dtype": "int8",
    "float32_matmul_precision": "high",
}
REQUEST_CHANGES: dict[str, dict[str, Any]] = {
    "endpoint": {"endpoint": "completions"},
    "messages": {"messages": [{"role": "user", "content": "hello!"}]},
    "prompt": {"messages": None, "prompt": "hello"},
    "options.echo": {"options": {"echo": True}},
    "options.add_generation_prompt": {"options": {"add_generation_prompt": False}},
    "options.chat_template_kwargs": {"options": {"chat_template_kwargs": {"enable_thinking": False}}},
}


def test_every_sampling_field_has_a_case() -> None:
    assert set(SAMPLING_CHANGES) == set(_DEFAULTS)  # a new SamplingParams field needs its case here


@pytest.mark.parametrize("field", sorted(SAMPLING_CHANGES))
def test_each_sampling_field_changes_the_key(field: str) -> None:
    value = SAMPLING_CHANGES[field]
    if field == "structured_outputs":
        from batchinfer.engine.sampling_params import StructuredOutputsParams

        value = StructuredOutputsParams(**value)
    assert _key(**{field: value}) != _key()


@pytest.mark.parametrize("field", sorted(IDENTITY_CHANGES))
def test_each_identity_field_changes_the_key(field: str) -> None:
    changed = dataclasses.replace(IDENTITY, **{field: IDENTITY_CHANGES[field]})
    assert _key(changed) != _key()


@pytest.mark.parametrize("field", sorted(REQUEST_CHANGES))
def test_each_request_field_changes_the_key(field: str) -> None:
    assert _key(**REQUEST_CHANGES[field]) != _key()


def test_an_auto_kv_cache_keeps_the_keys_computed_before_it_was_a_field() -> None:
    assert "kv_cache_dtype" not in IDENTITY.key_fields()  # auto: the keys stored so far still hit
    assert dataclasses.replace(IDENTITY, kv_cache_dtype="u8").key_fields()["kv_cache_dtype"] == "u8"


def test_provenance_names_a_quantized_kv_cache_and_only_then() -> None:
    """The estimate's forecast rebuilds a worker's identity from provenance: the KV dtype must be there."""
    auto = IDENTITY.provenance(seed=None, source="miss", computed_in=1)
    int8 = dataclasses.replace(IDENTITY, kv_cache_dtype="int8").provenance(seed=None, source="miss",
                                                                           computed_in=1)
    assert "kv_cache_dtype" not in auto
    assert int8.get("kv_cache_dtype") == "int8"


def test_float32_matmul_precision_keys_only_what_changes_cacheable_outputs() -> None:
    """"auto" runs only embeddings (never cached) in bf16x3: its generation keys are "highest"'s; "high"
    moves generation's outputs, so it keys apart; both are named in provenance, "highest" is not."""
    auto = dataclasses.replace(IDENTITY, float32_matmul_precision="auto")
    high = dataclasses.replace(IDENTITY, float32_matmul_precision="high")
    assert _key(auto) == _key() != _key(high)
    assert "float32_matmul_precision" not in IDENTITY.provenance(seed=None, source="miss", computed_in=1)
    for identity in (auto, high):
        provenance = identity.provenance(seed=None, source="miss", computed_in=1)
        assert provenance.get("float32_matmul_precision") == identity.float32_matmul_precision


@pytest.mark.parametrize("identity", [
    IDENTITY,
    dataclasses.replace(IDENTITY, adapter="a", adapter_fingerprint="a" * 64, kv_cache_dtype="int8"),
    dataclasses.replace(IDENTITY, float32_matmul_precision="auto"),
    dataclasses.replace(IDENTITY, float32_matmul_precision="high"),
])
def test_from_provenance_is_the_inverse_of_provenance(identity: ModelIdentity) -> None:
    provenance = identity.provenance(seed=None, source="miss", computed_in=1)
    assert ModelIdentity.from_provenance(provenance) == identity


def test_scope_and_numerics_version_change_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _key()
    assert _key(scope="owner:b") != base and _key(scope="global") != base
    monkeypatch.setattr(model_identity, "ENGINE_NUMERICS_VERSION", model_identity.ENGINE_NUMERICS_VERSION + 1)
    assert _key() != base


def test_same_request_same_key() -> None:
    assert _key() == _key() and len(_key()) == 64
    assert _key(stop=["a", "b"]) == _key(stop=["a", "b"])


def test_only_deterministic_requests_have_a_key() -> None:
    assert _key(seed=None, temperature=0.0) is not None  # greedy
    assert _key(seed=5, temperature=1.0) is not None  # seeded sampling
    assert _key(seed=None, temperature=0.8) is None  # unseeded sampling never hits
    assert _key(seed=None, temperature=1.0, top_k=1) is None  # sampled in form: not promised equal
    assert request_key(IDENTITY, _request(endpoint="embeddings"), scope="owner:a") is None


def test_fingerprint_follows_the_files_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "tokenizer.json").write_text("{}")
    (model / "tokenizer_config.json").write_text('{"chat_template": "A"}')
    cache = tmp_path / "fingerprints"
    first = fingerprint_dir(model, cache_dir=cache)
    assert first == fingerprint_dir(model, cache_dir=cache) and len(list(cache.iterdir())) == 1

    reads: list[Path] = []
    original = Path.open

    def counting_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        reads.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counting_open)
    assert fingerprint_dir(model, cache_dir=cache) == first
    assert [p for p in reads if p.parent == model] == []  # unchanged files: cached, no file read again
    monkeypatch.undo()

    # (each edit changes the size: a same-size rewrite within the clock's tick keeps size and mtime)
    edits = (("tokenizer_config.json", '{"chat_template": "BB"}'), ("tokenizer.json", '{"v": 2}'),
             ("model.safetensors", "weights2"))
    for name, content in edits:
        before = fingerprint_dir(model, cache_dir=cache)
        (model / name).write_text(content)
        assert fingerprint_dir(model, cache_dir=cache) != before, name


def test_a_bf16_cpu_worker_keys_its_results_under_the_cache_auto_resolves_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto under bfloat16 on CPU is a u8 cache (EngineConfig.resolved_kv_cache_dtype): the key and the
    provenance name it, the same key as an explicit u8; float32's auto keeps the keys stored before."""
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path / "cache"))  # the fingerprints' cache
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text("{}")

    def identity(**config: str) -> ModelIdentity:
        return model_identity.model_identity(EngineConfig(model=str(model), device="cpu", **config),
                                             served_model="m")

    auto = identity(dtype="bfloat16")
    assert auto.key_fields()["kv_cache_dtype"] == "u8"
    assert auto.provenance(seed=None, source="miss", computed_in=1).get("kv_cache_dtype") == "u8"
    assert auto.key_fields() == identity(dtype="bfloat16", kv_cache_dtype="u8").key_fields()
    assert "kv_cache_dtype" not in identity(dtype="float32").key_fields()
    float32 = identity(dtype="float32").key_fields()
    assert identity(dtype="float32", kv_cache_dtype="fp32").key_fields() == float32
    assert identity(dtype="bfloat16", kv_cache_dtype="bf16").key_fields() == identity(
        dtype="float32").key_fields() | {"dtype": "bfloat16"}  # the model dtype's own cache: no cache field


def test_an_int8_cpu_worker_keys_its_results_under_float32_and_u8(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 weights resolve auto to float32 activations and a u8 cache; both are in the key, and an explicit
    fp32 cache keys apart from it."""
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text("{}")

    def identity(**config: str) -> ModelIdentity:
        return model_identity.model_identity(EngineConfig(model=str(model), device="cpu", quantization="int8",
                                                          **config), served_model="m")

    auto = identity()
    assert auto.key_fields()["dtype"] == "float32" and auto.key_fields()["kv_cache_dtype"] == "u8"
    assert "kv_cache_dtype" not in identity(kv_cache_dtype="fp32").key_fields()
    assert identity(kv_cache_dtype="fp32").key_fields() != auto.key_fields()
