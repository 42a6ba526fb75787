"""Engine metrics carry vLLM's names and labels and move as the engine works (read from a registry)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from batchinfer.engine.llm import LLM
from batchinfer.engine.metrics import EngineMetrics, FinishedRequestStats, StepStats, model_label
from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.engine.stat_logger import StatLogger


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), device="cpu", max_num_seqs=8, num_kv_blocks=64)


def test_metrics_move_on_a_small_run(llm: LLM) -> None:
    labels = llm.engine.recorder.metrics.labels
    assert labels["model_name"] == "llama"  # the directory's name, never the path of the tiny model

    def value(name: str, **extra: str) -> float:
        found = REGISTRY.get_sample_value(name, {**labels, **extra})
        return 0.0 if found is None else found

    names = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "time_to_first_token_seconds_count",
             "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
             "iteration_tokens_total_count", "request_prefill_time_seconds_count",
             "request_decode_time_seconds_count", "request_prompt_tokens_count",
             "request_generation_tokens_count", "request_generation_tokens_sum")
    before = {name: value(f"batchinfer:{name}") for name in names}
    length_before = value("batchinfer:request_success_total", finished_reason="length")
    shared = "the cat reads the prompt " * 8
    prompts = [shared + f"and then question {i}" for i in range(6)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == 30
    delta = {name: value(f"batchinfer:{name}") - seen for name, seen in before.items()}
    assert delta["generation_tokens_total"] == generated
    assert delta["prompt_tokens_total"] > 0
    assert delta["prefix_cache_queries_total"] > 0
    assert delta["prefix_cache_hits_total"] > 0  # the shared prefix was reused
    assert delta["time_to_first_token_seconds_count"] == 6
    assert delta["inter_token_latency_seconds_count"] == 6 * 4
    assert delta["e2e_request_latency_seconds_count"] == 6
    assert delta["iteration_tokens_total_count"] >= 5
    for per_request in ("request_prefill_time_seconds_count", "request_decode_time_seconds_count",
                        "request_prompt_tokens_count", "request_generation_tokens_count"):
        assert delta[per_request] == 6, per_request
    assert delta["request_generation_tokens_sum"] == generated
    assert value("batchinfer:request_success_total", finished_reason="length") - length_before == 6
    assert value("batchinfer:num_requests_running") == 0
    assert value("batchinfer:kv_cache_usage_perc") == 0.0
    assert value("batchinfer:cache_config_info", block_size="16", num_gpu_blocks="64",
                 enable_prefix_caching="True") == 1
    exposition = generate_latest(REGISTRY).decode()
    for name in ("batchinfer:num_requests_waiting", "batchinfer:num_preemptions_total",
                 "batchinfer:request_queue_time_seconds_bucket"):
        assert name in exposition


def test_each_engine_of_a_model_gets_its_own_engine_label(llm: LLM, tiny_llama: Path) -> None:
    other = LLM(str(tiny_llama), device="cpu", max_num_seqs=2, num_kv_blocks=16)
    first, second = llm.engine.recorder.metrics, other.engine.recorder.metrics
    assert first.model_name == second.model_name == "llama"
    assert first.engine != second.engine  # two engines in one process never share a gauge
    other.generate(["one more prompt"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert REGISTRY.get_sample_value("batchinfer:generation_tokens_total", second.labels) == 2


def test_model_label_is_a_name_never_a_path(tmp_path: Path) -> None:
    (tmp_path / "my-model").mkdir()
    assert model_label(str(tmp_path / "my-model")) == "my-model"
    assert model_label(str(tmp_path / "weights" / "q4.gguf")) == "q4"
    assert model_label("smollm2-135m-instruct") == "smollm2-135m-instruct"  # an alias stays
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_label(hub_id) == hub_id  # a hub id is a name


def test_request_latencies_split_into_queue_prefill_and_decode() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics("m", registry, engine="0")
    metrics.record_finished(FinishedRequestStats(finished_reason="stop", arrival_time=100.0,
                                                 first_scheduled_time=101.0, first_token_time=103.5,
                                                 finished_time=110.0, num_prompt_tokens=40,
                                                 num_generation_tokens=7))
    labels = {"model_name": "m", "engine": "0"}

    def total(name: str) -> float | None:
        return registry.get_sample_value(f"batchinfer:{name}_sum", labels)

    assert total("request_queue_time_seconds") == 1.0
    assert total("request_prefill_time_seconds") == 2.5
    assert total("request_decode_time_seconds") == 6.5
    assert total("e2e_request_latency_seconds") == 10.0
    assert total("request_prompt_tokens") == 40 and total("request_generation_tokens") == 7
    # An aborted request that never got a token has no prefill or decode time.
    metrics.record_finished(FinishedRequestStats(finished_reason="abort", arrival_time=100.0,
                                                 first_scheduled_time=None, finished_time=101.0,
                                                 num_prompt_tokens=5, num_generation_tokens=0))
    assert registry.get_sample_value("batchinfer:request_prefill_time_seconds_count", labels) == 1
    assert registry.get_sample_value("batchinfer:request_success_total",
                                     {**labels, "finished_reason": "abort"}) == 1


def test_stat_logger_line_reports_throughput_and_hit_rate() -> None:
    logger = StatLogger(interval_s=5.0)
    first = StepStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, num_prompt_tokens=100,
                      num_generation_tokens=10, prefix_cache_queries=100, prefix_cache_hits=75)
    assert logger.record_step(first, now=logger._since + 1) is None
    second = StepStats(num_running=2, num_waiting=0, kv_cache_usage=0.5, num_generation_tokens=40)
    line = logger.record_step(second, now=logger._since + 10)
    assert line is not None
    assert "Avg prompt throughput: 10.0 tokens/s" in line
    assert "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 2 reqs, Waiting: 0 reqs" in line
    assert "KV cache usage: 50.0%" in line and "Prefix cache hit rate: 75.0%" in line
