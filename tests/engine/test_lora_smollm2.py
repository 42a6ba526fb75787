"""Multi-LoRA on the real SmolLM2-135M-Instruct: a mixed batch (base + two r=8 adapters on all seven
projections) equals transformers' greedy output of the base with each adapter merged, in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine import LLM, LoRARequest, SamplingParams
from tests.fixtures.tiny_lora import ALL_PROJECTIONS, hf_greedy, merged_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

MAX_NEW = 12
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "What does a CPU do?", "Give me a synonym for 'happy'.", "How many legs does a spider have?"]


def _adapter(base: Path, directory: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS, init_lora_weights=False,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # a trained adapter's size of delta: it changes the text without drowning it
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.1)
    peft_model.save_pretrained(directory, safe_serialization=True)
    return directory


def test_mixed_adapters_equal_merged_models(smollm2, tmp_path) -> None:
    adapters = {name: _adapter(smollm2, tmp_path / name, seed) for name, seed in (("a1", 1), ("a2", 2))}
    llm = LLM(str(smollm2), device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=64,
              enable_lora=True, max_num_batched_tokens=64)  # chunked prefill too
    requests = [None, LoRARequest("a1", 1, str(adapters["a1"])), LoRARequest("a2", 2, str(adapters["a2"]))]
    loras = [requests[i % 3] for i in range(len(QUESTIONS))]
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                          add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outputs = llm.generate(prompt_ids, greedy, lora_request=loras)
    models = {name: merged_model(smollm2, adapters.get(name)) for name in (None, "a1", "a2")}
    changed = 0
    for out, lora in zip(outputs, loras, strict=True):
        name = None if lora is None else lora.lora_name
        expected = hf_greedy(models[name], out.prompt_token_ids, MAX_NEW)
        assert out.outputs[0].token_ids == expected, name
        if name is not None:
            changed += expected != hf_greedy(models[None], out.prompt_token_ids, MAX_NEW)
    assert changed >= 2
