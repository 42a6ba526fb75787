"""Engine metrics are exported with vLLM's names and move as the engine works (scraped from a registry)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest

from batchinfer.engine.llm import LLM
from batchinfer.engine.metrics import StatLogger, StepStats
from batchinfer.engine.sampling_params import SamplingParams


def _value(name: str, model: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, {"model_name": model, **labels})
    return 0.0 if value is None else value


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), device="cpu", max_num_seqs=8, num_kv_blocks=64)


def test_metrics_move_on_a_small_run(llm: LLM) -> None:
    model = llm.engine.config.model
    before = {name: _value(name, model) for name in (
        "batchinfer:prompt_tokens_total", "batchinfer:generation_tokens_total",
        "batchinfer:prefix_cache_queries_total", "batchinfer:prefix_cache_hits_total",
        "batchinfer:time_to_first_token_seconds_count", "batchinfer:inter_token_latency_seconds_count",
        "batchinfer:e2e_request_latency_seconds_count", "batchinfer:iteration_tokens_total_count")}
    length_before = _value("batchinfer:request_success_total", model, finished_reason="length")
    shared = "the cat reads the prompt " * 8
    prompts = [shared + f"and then question {i}" for i in range(6)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == 30
    delta = {name: _value(name, model) - value for name, value in before.items()}
    assert delta["batchinfer:generation_tokens_total"] == generated
    assert delta["batchinfer:prompt_tokens_total"] > 0
    assert delta["batchinfer:prefix_cache_queries_total"] > 0
    assert delta["batchinfer:prefix_cache_hits_total"] > 0  # the shared prefix was reused
    assert delta["batchinfer:time_to_first_token_seconds_count"] == 6
    assert delta["batchinfer:inter_token_latency_seconds_count"] == 6 * 4
    assert delta["batchinfer:e2e_request_latency_seconds_count"] == 6
    assert delta["batchinfer:iteration_tokens_total_count"] >= 5
    assert _value("batchinfer:request_success_total", model, finished_reason="length") - length_before == 6
    assert _value("batchinfer:num_requests_running", model) == 0
    assert _value("batchinfer:kv_cache_usage_perc", model) == 0.0
    exposition = generate_latest(REGISTRY).decode()
    for name in ("batchinfer:num_requests_waiting", "batchinfer:num_preemptions_total",
                 "batchinfer:request_queue_time_seconds_bucket"):
        assert name in exposition


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
