"""SamplingParams and EngineConfig: vLLM defaults, normalization, field errors, storage, light imports."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import orjson
import pytest

from batchinfer.engine.config import EngineConfig, cpu_has_native_bf16
from batchinfer.engine.sampling_params import SamplingParams, SamplingParamsError


def test_vllm_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.has_penalties


def test_normalization() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6] and p.top_k == 0 and p.is_greedy
    assert SamplingParams(frequency_penalty=0.1).has_penalties


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:") as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, SamplingParamsError) and info.value.field == field
    message = info.value.message
    assert str(info.value) == f"{field}: {message}" and not message.startswith(f"{field}:")


STORED = [
    SamplingParams(),
    SamplingParams(max_tokens=None),
    SamplingParams(temperature=0, max_tokens=20, stop="###", stop_token_ids=(5, 6), top_k=-1, seed=0),
    SamplingParams(n=3, top_p=0.9, min_p=0.05, presence_penalty=-0.2, frequency_penalty=0.1,
                   repetition_penalty=1.1, min_tokens=2, logprobs=4, ignore_eos=True,
                   include_stop_str_in_output=True, skip_special_tokens=False),
]


@pytest.mark.parametrize("params", STORED)
def test_to_dict_round_trips_through_json(params: SamplingParams) -> None:
    stored = orjson.loads(orjson.dumps(params.to_dict()))  # as the requests table holds it
    assert SamplingParams.from_dict(stored) == params
    assert SamplingParams(**stored) == params  # the dict is also valid constructor input


def test_to_dict_keeps_only_what_differs_from_the_defaults() -> None:
    assert SamplingParams().to_dict() == {}
    assert SamplingParams(max_tokens=None, temperature=1.0, stop=[]).to_dict() == {"max_tokens": None}
    assert SamplingParams(stop="x", top_k=-1).to_dict() == {"stop": ["x"]}


def test_from_dict_reads_rows_stored_before_to_dict() -> None:
    # Ingest used to store the body's sampling fields as given; the same object must come back.
    raw = {"max_tokens": None, "stop": "###", "stop_token_ids": None, "top_k": -1, "ignore_eos": False}
    assert SamplingParams.from_dict(raw) == SamplingParams(**raw)
    assert SamplingParams.from_dict(raw).stop == ["###"]
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_from_dict_trusts_stored_params_and_does_not_validate_again(monkeypatch: pytest.MonkeyPatch) -> None:
    stored = SamplingParams(temperature=0.2, max_tokens=5, stop=["."]).to_dict()

    def validate(self: SamplingParams) -> None:
        raise AssertionError("from_dict validated again")

    monkeypatch.setattr(SamplingParams, "__post_init__", validate)
    rebuilt = SamplingParams.from_dict(stored)
    assert (rebuilt.temperature, rebuilt.max_tokens, rebuilt.stop) == (0.2, 5, ["."])


def test_params_are_frozen_so_one_can_be_shared() -> None:
    params = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0  # type: ignore[misc]
    assert dataclasses.replace(params, n=2) == SamplingParams(temperature=0.5, n=2)


def test_child_seeds_are_deterministic_and_distinct() -> None:
    p = SamplingParams(seed=7, n=4)
    seeds = [p.seed_for_child(i) for i in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [SamplingParams(seed=7, n=4).seed_for_child(i) for i in range(4)]
    assert SamplingParams(seed=8).seed_for_child(0) not in seeds
    assert SamplingParams().seed_for_child(3) is None


def test_engine_config_defaults_and_resolution() -> None:
    config = EngineConfig(model="m", device="cpu")
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (256, 4096, 16)
    assert config.enable_prefix_caching and config.max_model_len is None and config.num_kv_blocks is None
    assert config.resolved_device() == "cpu"
    assert str(config.resolved_dtype()) == ("torch.bfloat16" if cpu_has_native_bf16() else "torch.float32")
    assert str(EngineConfig(model="m", device="cpu", dtype="bfloat16").resolved_dtype()) == "torch.bfloat16"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": ""}, "model"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ],
)
def test_engine_config_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        EngineConfig(**{"model": "m", **kwargs})


def test_importing_params_and_engine_package_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import batchinfer.engine as engine\n"
        "from batchinfer.engine import SamplingParams, EngineConfig\n"
        "SamplingParams(temperature=0.5, stop=['x']); EngineConfig(model='m')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
