"""Multi-LoRA in the engine: mixed batches of the base model and two PEFT adapters (r=8, alpha=16, all seven
projections) equal peft's merged models greedy token for token in fp32, with chunked prefill and
preemption; the prefix cache never crosses adapters; eviction under max_cpu_loras keeps outputs right.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from batchinfer.engine import LoRARequest, SamplingParams
from batchinfer.engine.lora.layers import LoRASegment, build_lora_batch
from tests.fixtures.tiny_lora import build_lora_adapter, hf_greedy, merged_model
from tests.fixtures.tiny_models import training_sentences

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SCENARIOS = {
    "roomy": {},
    "preempting": {"num_kv_blocks": 14, "block_size": 8},  # 112 slots for 15 sequences of ~20-60 tokens
    "chunked": {"max_num_batched_tokens": 16},
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random adapters of the tiny Llama, and one trained with rsLoRA on q/v only."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "a1": build_lora_adapter(tiny_llama, root / "a1", seed=1),
        "a2": build_lora_adapter(tiny_llama, root / "a2", seed=2),
        "rs": build_lora_adapter(tiny_llama, root / "rs", seed=3, r=4, lora_alpha=8, use_rslora=True,
                                 target_modules=["q_proj", "v_proj"]),
    }


@functools.cache
def _reference(base: str, adapter: str | None) -> torch.nn.Module:
    model = merged_model(Path(base), None if adapter is None else Path(adapter))
    model.generation_config.eos_token_id = None  # like ignore_eos
    return model


def reference_tokens(base: Path, adapter: Path | None, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy tokens of the base with `adapter` merged (W + scaling * B @ A)."""
    return hf_greedy(_reference(str(base), None if adapter is None else str(adapter)), prompt_ids, MAX_NEW)


def prompts(count: int) -> list[str]:
    sentences = training_sentences(60, seed=7)
    return [" ".join(sentences[i : i + 1 + i % 4]) for i in range(count)]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mixed_batch_equals_peft_merged(make_llm, tiny_llama, adapters, scenario: str) -> None:
    llm = make_llm(tiny_llama, enable_lora=True, **SCENARIOS[scenario])
    requests = [None, LoRARequest("a1", 1, str(adapters["a1"])), LoRARequest("a2", 2, str(adapters["a2"]))]
    loras = [requests[i % 3] for i in range(15)]
    outputs = llm.generate(prompts(15), GREEDY, lora_request=loras)
    if scenario == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    changed = 0
    for out, lora in zip(outputs, loras, strict=True):
        adapter = None if lora is None else adapters[lora.lora_name]
        expected = reference_tokens(tiny_llama, adapter, out.prompt_token_ids)
        assert out.outputs[0].token_ids == expected, (scenario, lora)
        if lora is not None:
            changed += expected != reference_tokens(tiny_llama, None, out.prompt_token_ids)
    assert changed >= 8, "the adapters should change most outputs"


def test_rslora_scaling_and_partial_targets(make_llm, tiny_llama, adapters) -> None:
    llm = make_llm(tiny_llama, enable_lora=True)
    lora = LoRARequest("rs", 7, str(adapters["rs"]))
    outputs = llm.generate(prompts(4), GREEDY, lora_request=lora)
    for out in outputs:
        assert out.outputs[0].token_ids == reference_tokens(tiny_llama, adapters["rs"], out.prompt_token_ids)


def test_without_adapters_the_base_path_is_untouched(make_llm, tiny_llama, adapters) -> None:
    """Contract 6: base-only steps carry no LoRABatch and give bit-identical logits."""
    plain = make_llm(tiny_llama)
    lora_llm = make_llm(tiny_llama, enable_lora=True)
    lora_llm.generate(prompts(2), GREEDY, lora_request=LoRARequest("a1", 1, str(adapters["a1"])))
    seqs = []
    for llm in (plain, lora_llm):
        params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=5)
        seqs.append(llm.generate(prompts(6), params))
    for a, b in zip(*seqs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert lora_llm.engine.model_runner.lora_manager.batch_for([]) is None


def test_prefix_cache_never_crosses_adapters(make_llm, tiny_llama, adapters) -> None:
    llm = make_llm(tiny_llama, enable_lora=True, block_size=8)
    prompt = " ".join(training_sentences(8, seed=9))  # several full blocks
    a1 = LoRARequest("a1", 1, str(adapters["a1"]))
    a2 = LoRARequest("a2", 2, str(adapters["a2"]))
    cached = {}
    for name, lora in [("base", None), ("a1", a1), ("a2", a2), ("a1 again", a1), ("base again", None)]:
        out = llm.generate([prompt], GREEDY, lora_request=lora)[0]
        cached[name] = out.num_cached_tokens
        adapter = None if lora is None else adapters[lora.lora_name]
        assert out.outputs[0].token_ids == reference_tokens(tiny_llama, adapter, out.prompt_token_ids)
    assert cached["base"] == cached["a1"] == cached["a2"] == 0
    assert cached["a1 again"] > 0 and cached["base again"] > 0


def test_eviction_under_max_cpu_loras_keeps_outputs_right(make_llm, tiny_llama, adapters) -> None:
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=1)
    requests = [LoRARequest("a1", 1, str(adapters["a1"])), LoRARequest("a2", 2, str(adapters["a2"])), None]
    loras = [requests[i % 3] for i in range(9)]
    outputs = llm.generate(prompts(9), GREEDY, lora_request=loras)
    manager = llm.engine.model_runner.lora_manager
    assert len(manager.loaded) == 1 and manager.num_loads > 2  # evicted and read again
    for out, lora in zip(outputs, loras, strict=True):
        adapter = None if lora is None else adapters[lora.lora_name]
        assert out.outputs[0].token_ids == reference_tokens(tiny_llama, adapter, out.prompt_token_ids)


def test_segments_of_the_step_layout() -> None:
    """Adjacent entries of one adapter share a slice; scattered ones gather; base rows get nothing."""
    first, second = object(), object()
    batch = build_lora_batch([first, None, first, first, second], [2, 3, 1, 2, 4], torch.device("cpu"))
    rows = {id(s.adapter): s.rows for s in batch.segments}
    assert torch.equal(rows[id(first)], torch.tensor([0, 1, 5, 6, 7]))
    assert rows[id(second)] == slice(8, 12)
    assert build_lora_batch([None, None], [1, 2], torch.device("cpu")) is None
    assert isinstance(batch.segments[0], LoRASegment)


def test_lora_request_without_enable_lora_is_refused(make_llm, tiny_llama, adapters) -> None:
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("a1", 1, str(adapters["a1"])))


def test_one_id_names_one_adapter(make_llm, tiny_llama, adapters) -> None:
    llm = make_llm(tiny_llama, enable_lora=True)
    llm.generate(["hi"], GREEDY, lora_request=LoRARequest("a1", 1, str(adapters["a1"])))
    with pytest.raises(ValueError, match="lora_int_id: 1 already names adapter 'a1'"):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("a2", 1, str(adapters["a2"])))


def test_engine_options_are_checked() -> None:
    from batchinfer.engine.config import EngineConfig

    with pytest.raises(ValueError, match="max_cpu_loras: must be >= 4"):
        EngineConfig(model="m", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig(model="m", max_lora_rank=0)
    assert EngineConfig(model="m", max_loras=3).max_cpu_loras == 3
    with pytest.raises(ValueError, match="pipeline_parallel_size=1"):
        EngineConfig(model="m", enable_lora=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


def test_lora_requests_info_names_running_and_waiting_adapters(make_llm, tiny_llama, adapters) -> None:
    from prometheus_client import REGISTRY

    llm = make_llm(tiny_llama, enable_lora=True, max_loras=1)
    engine = llm.engine
    for i, name in enumerate(["a1", "a2"]):
        lora = LoRARequest(name, i + 1, str(adapters[name]))
        engine.add_request(f"r{i}", prompts(1)[0], GREEDY, lora_request=lora)
    engine.add_request("base", prompts(1)[0], GREEDY)
    engine.step()  # max_loras=1: a1 runs, a2 waits for it
    labels = {**engine.recorder.metrics.labels, "max_lora": "1", "running_lora_adapters": "a1",
              "waiting_lora_adapters": "a2"}
    assert REGISTRY.get_sample_value("batchinfer:lora_requests_info", labels) > 0
    assert [seq.request_id for seq in engine.scheduler.running] == ["r0"]
    while engine.has_unfinished():
        engine.step()


def test_chat_takes_a_lora_request(make_llm, tiny_llama, adapters) -> None:
    llm = make_llm(tiny_llama, enable_lora=True)
    lora = LoRARequest("a1", 1, str(adapters["a1"]))
    conversation = [{"role": "user", "content": "the cat reads the prompt"}]
    chat = llm.chat(conversation, GREEDY, lora_request=lora)[0]
    plain = llm.generate([chat.prompt_token_ids], GREEDY, lora_request=lora)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert chat.outputs[0].token_ids == reference_tokens(tiny_llama, adapters["a1"], chat.prompt_token_ids)


def test_speculative_draft_model_with_adapters_stays_exact(make_llm, tiny_llama, adapters, tmp_path) -> None:
    """The draft proposes from its own base (the target's adapters do not fit it); verification under the
    adapter keeps greedy output equal to the merged model's."""
    from batchinfer.engine.spec_decode.truncated_draft import write_truncated_draft

    draft = write_truncated_draft(tiny_llama, tmp_path / "draft", num_layers=1) or tmp_path / "draft"
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                   "disable_by_batch_size": 1024}
    llm = make_llm(tiny_llama, enable_lora=True, speculative_config=speculative)
    requests = [None, LoRARequest("a1", 1, str(adapters["a1"])), LoRARequest("a2", 2, str(adapters["a2"]))]
    loras = [requests[i % 3] for i in range(6)]
    outputs = llm.generate(prompts(6), GREEDY, lora_request=loras)
    for out, lora in zip(outputs, loras, strict=True):
        adapter = None if lora is None else adapters[lora.lora_name]
        assert out.outputs[0].token_ids == reference_tokens(tiny_llama, adapter, out.prompt_token_ids)
