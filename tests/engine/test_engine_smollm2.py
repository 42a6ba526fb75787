"""The real SmolLM2-135M-Instruct: chat prompts batched through the engine equal transformers' greedy."""

from __future__ import annotations

import pytest
import torch

from batchinfer.engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

MAX_NEW = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Give me a synonym for 'happy'.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
]


def test_chat_batch_equals_transformers_greedy(smollm2) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(smollm2), device="cpu", dtype="float32", max_model_len=1024, num_kv_blocks=256)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert len(outputs) >= 8

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for out in outputs:
        prompt = torch.tensor([out.prompt_token_ids])
        ref = model.generate(
            prompt, max_new_tokens=MAX_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        ref_tokens = ref.sequences[0, prompt.shape[1] :].tolist()
        ours = out.outputs[0].token_ids
        diverge = next((k for k, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)) if a != b), None)
        if diverge is not None:
            logits = ref.logits[diverge][0]
            gap = abs(logits[ours[diverge]] - logits[ref_tokens[diverge]]).item()
            pytest.fail(
                f"{out.prompt!r}: token {diverge} differs "
                f"({ours[diverge]} vs {ref_tokens[diverge]}), logit gap {gap}"
            )
        assert ours == ref_tokens
        finish = "stop" if ours[-1] in llm.engine.eos_token_ids else "length"
        assert out.outputs[0].finish_reason == finish
        assert out.outputs[0].text == llm.get_tokenizer().decode(ours, skip_special_tokens=True)
    assert sum(len(o.outputs[0].token_ids) for o in outputs) >= 8 * 16  # real answers, not instant EOS
    llm.engine.block_manager.check_invariants([])
    assert llm.engine.block_manager.num_used_blocks == 0
