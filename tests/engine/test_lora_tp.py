"""Multi-LoRA under tensor parallelism (CPU, gloo, fp32): each rank holds its share of every adapter (A
split like the base weight's input, B like its output, replicated KV heads included) and the ranks'
partial deltas sum in the all-reduce: tp=2 and tp=4 generate what peft's merged models generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.engine import LLM, LoRARequest
from batchinfer.engine.parallel.distributed import tp_world_size
from tests.engine.test_lora import GREEDY, prompts, reference_tokens
from tests.fixtures.tiny_lora import build_lora_adapter


@pytest.fixture(scope="module")
def tp_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_tp")
    return {name: build_lora_adapter(tiny_llama, root / name, seed=seed) for name, seed in (("a1", 1),
                                                                                          ("a2", 2))}


@pytest.mark.parametrize("tp", [2, 4])  # the tiny Llama's 2 KV heads: split at 2, replicated at 4
def test_tensor_parallel_lora_equals_merged(tiny_llama, tp_adapters, tp: int) -> None:
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", tensor_parallel_size=tp, enable_lora=True,
              num_kv_blocks=24, block_size=4, max_num_seqs=6)  # preemption too
    try:
        requests = [None, LoRARequest("a1", 1, str(tp_adapters["a1"])),
                    LoRARequest("a2", 2, str(tp_adapters["a2"]))]
        loras = [requests[i % 3] for i in range(9)]
        outputs = llm.generate(prompts(9), GREEDY, lora_request=loras)
        with pytest.raises(ValueError, match="rank 8 exceeds"):  # checked on rank 0: nothing reaches a worker
            llm.engine.model_runner.runner.lora_manager.max_lora_rank = 4
            llm.generate(["hi"], GREEDY, lora_request=LoRARequest("a3", 3, str(tp_adapters["a1"])))
    finally:
        llm.close()
    assert tp_world_size() == 1
    for out, lora in zip(outputs, loras, strict=True):
        adapter = None if lora is None else tp_adapters[lora.lora_name]
        assert out.outputs[0].token_ids == reference_tokens(tiny_llama, adapter, out.prompt_token_ids), lora
