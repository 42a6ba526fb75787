"""The model fixtures are what the engine tests take them for: the architectures they claim, and a real
SmolLM2 conversion that transformers answers correctly from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _greedy(path: Path, messages: list[dict], max_new_tokens: int) -> tuple[list[int], str]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


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
