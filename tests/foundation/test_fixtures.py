"""The model fixtures produce models transformers can generate from: the reference later engine tests use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _greedy(path: Path, messages: list[dict], max_new_tokens: int) -> tuple[list[int], str]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_tiny_model_generates(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    tokens, _ = _greedy(path, [{"role": "user", "content": "the cat reads the prompt"}], 8)
    assert len(tokens) == 8
    # Same weights and input: greedy decoding is deterministic.
    assert _greedy(path, [{"role": "user", "content": "the cat reads the prompt"}], 8)[0] == tokens


def test_tiny_models_differ_in_architecture(tiny_llama: Path, tiny_qwen2: Path) -> None:
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama)
    qwen = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert llama.config.num_key_value_heads < llama.config.num_attention_heads  # GQA
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None  # qkv bias
    assert qwen.config.tie_word_embeddings and not llama.config.tie_word_embeddings


@pytest.mark.slow
def test_smollm2_generates(smollm2: Path) -> None:
    tokens, text = _greedy(smollm2, [{"role": "user", "content": "What is the capital of France?"}], 12)
    assert len(tokens) == 12
    assert "Paris" in text, text
