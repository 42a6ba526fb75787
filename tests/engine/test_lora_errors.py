"""A PEFT adapter that cannot run on the engine's model is a clear error at load, naming what is wrong:
a rank above max_lora_rank, another base model's shapes (naming the tensor), DoRA, trained biases,
other modules, missing files. Nothing runs under it, and the engine keeps serving.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchinfer.engine import LoRARequest, SamplingParams
from batchinfer.engine.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRAError
from tests.fixtures.tiny_lora import build_lora_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def good_adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lora_adapter(tiny_llama, tmp_path_factory.mktemp("lora") / "good", seed=4)


@pytest.fixture
def copy_adapter(good_adapter: Path, tmp_path: Path):
    def copy() -> Path:
        target = tmp_path / "adapter"
        shutil.copytree(good_adapter, target)
        return target

    return copy


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    config.update(changes)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    edit(tensors)
    save_file(tensors, str(path / ADAPTER_WEIGHTS))


def _load_error(make_llm, tiny_llama: Path, adapter: Path, **engine) -> str:
    llm = make_llm(tiny_llama, enable_lora=True, **engine)
    with pytest.raises(ValueError) as info:
        llm.generate(["hello"], GREEDY, lora_request=LoRARequest("bad", 1, str(adapter)))
    assert isinstance(info.value.__cause__ or info.value, ValueError)
    assert llm.generate(["hello"], GREEDY)[0].outputs[0].token_ids  # the engine keeps serving
    return str(info.value)


def test_rank_above_max_lora_rank(make_llm, tiny_llama, good_adapter) -> None:
    message = _load_error(make_llm, tiny_llama, good_adapter, max_lora_rank=4)
    assert "rank 8 exceeds max_lora_rank=4" in message and "--max-lora-rank" in message


def test_adapter_of_another_base_names_the_tensor(make_llm, tiny_llama, copy_adapter) -> None:
    adapter = copy_adapter()
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    _edit_tensors(adapter, lambda t: t.__setitem__(name, torch.zeros(8, 96)))
    message = _load_error(make_llm, tiny_llama, adapter)
    assert "model.layers.1.down_proj.lora_A/B.weight" in message
    assert "(8, 96)" in message and "(8, 128)" in message and "another base model" in message


def test_adapter_with_more_layers_than_the_base(make_llm, tiny_llama, copy_adapter) -> None:
    adapter = copy_adapter()
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    _edit_tensors(adapter, lambda t: t.__setitem__(name.replace("layers.1", "layers.5"), t[name].clone()))
    assert "layer 5 does not exist" in _load_error(make_llm, tiny_llama, adapter)


@pytest.mark.parametrize(("change", "expected"), [
    ({"use_dora": True}, "use_dora: DoRA adapters are not supported"),
    ({"bias": "all"}, "bias: adapters that train biases are not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "only LORA adapters"),
])
def test_unsupported_options(make_llm, tiny_llama, copy_adapter, change, expected) -> None:
    adapter = copy_adapter()
    _edit_config(adapter, **change)
    assert expected in _load_error(make_llm, tiny_llama, adapter)


def test_tensor_of_another_module(make_llm, tiny_llama, copy_adapter) -> None:
    adapter = copy_adapter()
    name = "base_model.model.lm_head.lora_A.weight"
    _edit_tensors(adapter, lambda t: t.__setitem__(name, torch.zeros(8, 64)))
    assert "lm_head.lora_A.weight: not a LoRA A/B weight" in _load_error(make_llm, tiny_llama, adapter)


def test_missing_files(make_llm, tiny_llama, copy_adapter, tmp_path) -> None:
    adapter = copy_adapter()
    (adapter / ADAPTER_WEIGHTS).unlink()
    assert f"{ADAPTER_WEIGHTS} is missing" in _load_error(make_llm, tiny_llama, adapter)
    (adapter / ADAPTER_CONFIG).unlink()
    assert f"{ADAPTER_CONFIG} is missing" in _load_error(make_llm, tiny_llama, adapter)
    assert "is not a directory" in _load_error(make_llm, tiny_llama, tmp_path / "nowhere")


def test_a_damaged_weights_file_is_a_load_error(make_llm, tiny_llama, copy_adapter) -> None:
    adapter = copy_adapter()
    weights = adapter / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])  # a partial copy: safetensors' own error is no ValueError
    assert f"{ADAPTER_WEIGHTS}: cannot be read as safetensors" in _load_error(make_llm, tiny_llama, adapter)


def test_lora_error_carries_its_field(tiny_llama, copy_adapter) -> None:
    from transformers import AutoConfig

    from batchinfer.engine.lora.adapter import load_adapter

    adapter = copy_adapter()
    _edit_config(adapter, use_dora=True)
    with pytest.raises(LoRAError) as info:
        load_adapter("x", adapter, hf_config=AutoConfig.from_pretrained(tiny_llama), max_lora_rank=16,
                     dtype=torch.float32)
    assert info.value.field == f"{ADAPTER_CONFIG}: use_dora"


def test_adapter_fingerprint_follows_the_files(copy_adapter, good_adapter) -> None:
    from batchinfer.engine.lora.adapter import adapter_fingerprint

    adapter = copy_adapter()
    assert adapter_fingerprint(adapter) == adapter_fingerprint(good_adapter)  # same files, another place
    _edit_config(adapter, lora_alpha=32)
    assert adapter_fingerprint(adapter) != adapter_fingerprint(good_adapter)


def test_max_adapter_bytes_bounds_a_full_adapter(tiny_llama, good_adapter) -> None:
    """The room a CUDA engine sets aside per adapter fits an adapter of max_lora_rank on every projection."""
    from transformers import AutoConfig

    from batchinfer.engine.lora.adapter import load_adapter, max_adapter_bytes

    hf_config = AutoConfig.from_pretrained(tiny_llama)
    adapter = load_adapter("x", good_adapter, hf_config=hf_config, max_lora_rank=8, dtype=torch.float32)
    assert max_adapter_bytes(hf_config, max_lora_rank=8, itemsize=4) == adapter.num_bytes  # rank 8, all 7
    assert max_adapter_bytes(hf_config, max_lora_rank=8, itemsize=4, tp_size=2) < adapter.num_bytes
