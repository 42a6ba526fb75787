"""Prefix caching on a shared system prompt: the same workload with the prefix cache on and off.

Workload: --num-requests chat requests (default 256) on SmolLM2-135M-Instruct (the `smollm2-135m-instruct`
alias), each a ~--system-tokens (default 1,000) token system prompt shared by all, plus a distinct short
user question; greedy, --max-tokens new tokens each (default 8), fp32 on CPU. Two LLM instances with the
same settings except enable_prefix_caching (True / False) run it one after the other, and the script
prints for each: prompt tokens actually computed (EngineStats.prompt_tokens), the prefix-cache hit rate
(hits / queries in tokens and in blocks), the share of the shared system-prompt tokens served from the
cache, the total time, TTFT p50 / p99, then the ratios and a markdown table.

TTFT is RequestOutput.metrics.first_token_time - arrival_time. Every request is added at t = 0 (one
generate() call), so TTFT includes the time a request waits in the queue behind the others: it measures
how soon the batch's first tokens appear, not a single request's latency on an idle engine.

    .venv/bin/python bench/prefix_cache.py                     # 256 requests: the cache-off run prefills
                                                               # ~265k tokens, about 30-40 min on 1 CPU thread
    .venv/bin/python bench/prefix_cache.py --num-requests 32   # ~4-5 min on a busy 2-core box
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

MODEL = "smollm2-135m-instruct"
RULE_TOPICS = [
    "refunds", "shipping delays", "damaged parcels", "gift cards", "account security", "password resets",
    "invoices", "bulk orders", "student discounts", "warranty claims", "returns without a receipt",
    "international customs", "loyalty points", "subscription pauses", "price matching", "data deletion",
]
RULE_ACTIONS = [
    "Always confirm the order number before you", "Never promise a date when you",
    "Politely explain the policy if", "Escalate to a supervisor only when",
    "Write a short summary in the ticket after you", "Offer store credit if",
]
RULE_ENDS = [
    "discuss {}.", "handle {} for a customer.", "the customer asks about {}.",
    "a request about {} is unclear.", "close a conversation about {}.", "someone is upset about {}.",
]


@dataclass
class RunResult:
    label: str
    seconds: float
    prompt_tokens_computed: int
    generation_tokens: int
    queries: int
    hits: int
    block_queries: int
    block_hits: int
    cached_per_request: list[int]
    ttfts: list[float]
    outputs: list[list[int]]


def system_prompt(tokenizer, target_tokens: int) -> str:
    """A deterministic customer-support handbook of about `target_tokens` tokens."""
    lines = ["You are the support assistant of Acme Outdoor Gear. Follow the handbook below exactly."]
    rule = 0
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < target_tokens:
        topic = RULE_TOPICS[rule % len(RULE_TOPICS)]
        action = RULE_ACTIONS[(rule * 5) % len(RULE_ACTIONS)]
        end = RULE_ENDS[(rule * 7) % len(RULE_ENDS)].format(topic)
        rule += 1
        lines.append(f"Rule {rule}: {action} {end}")
    return "\n".join(lines)


def build_prompts(tokenizer, num_requests: int, system_tokens: int) -> tuple[list[list[int]], int]:
    """Chat-templated token ids (shared system prompt + distinct question) and their shared prefix length."""
    system = system_prompt(tokenizer, system_tokens)
    prompts = []
    for i in range(num_requests):
        topic = RULE_TOPICS[i % len(RULE_TOPICS)]
        question = f"Customer #{i}: what should I do about {topic} for order {1000 + 37 * i}?"
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
            tokenize=False, add_generation_prompt=True,
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    shared = min(map(len, prompts))  # the longest prefix common to every prompt
    for prompt in prompts[1:]:
        shared = next((j for j in range(shared) if prompt[j] != prompts[0][j]), shared)
    return prompts, shared


def run(label: str, prompts: list[list[int]], max_tokens: int, *, enable_prefix_caching: bool) -> RunResult:
    """One LLM instance, one generate() over every prompt; figures from its engine."""
    from batchinfer.engine.llm import LLM
    from batchinfer.engine.sampling_params import SamplingParams

    llm = LLM(MODEL, device="cpu", dtype="float32", enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = llm.engine.get_stats()
    result = RunResult(
        label=label,
        seconds=seconds,
        prompt_tokens_computed=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
        queries=stats.prefix_cache_queries,
        hits=stats.prefix_cache_hits,
        block_queries=stats.prefix_cache_block_queries,
        block_hits=stats.prefix_cache_block_hits,
        cached_per_request=[o.num_cached_tokens for o in outputs],
        ttfts=[o.metrics.first_token_time - o.metrics.arrival_time for o in outputs],
        outputs=[list(o.outputs[0].token_ids) for o in outputs],
    )
    del llm, outputs
    gc.collect()
    return result


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def describe(result: RunResult, shared: int) -> dict[str, str]:
    """The figures of one run, formatted."""
    served = sum(min(cached, shared) for cached in result.cached_per_request)
    hit_rate = f"{result.hits / result.queries:.1%}" if result.queries else "n/a (cache off)"
    block_rate = f"{result.block_hits / result.block_queries:.1%}" if result.block_queries else "n/a"
    return {
        "prompt tokens computed": f"{result.prompt_tokens_computed:,}",
        "prefix-cache hit rate (tokens)": hit_rate,
        "prefix-cache hit rate (blocks)": block_rate,
        "shared-prompt tokens from cache": f"{served / (shared * len(result.cached_per_request)):.1%}",
        "total time (s)": f"{result.seconds:.1f}",
        "TTFT p50 (s)": f"{statistics.median(result.ttfts):.2f}",
        "TTFT p99 (s)": f"{percentile(result.ttfts, 99):.2f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared, busy machine)")
    args = parser.parse_args()
    if args.num_requests < 2:
        parser.error("--num-requests must be >= 2 (one request has nothing to share)")
    torch.set_num_threads(args.threads)

    from transformers.utils import logging as hf_logging

    from batchinfer.engine.model_files import resolve_model_path
    from batchinfer.engine.models.loader import load_tokenizer

    hf_logging.set_verbosity_error()
    tokenizer = load_tokenizer(resolve_model_path(MODEL))
    prompts, shared = build_prompts(tokenizer, args.num_requests, args.system_tokens)
    total_prompt = sum(map(len, prompts))
    print(f"machine: {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    print(f"workload: {len(prompts)} chat requests, {total_prompt:,} prompt tokens, "
          f"shared prefix {shared} tokens (system prompt + template), "
          f"{total_prompt / len(prompts) - shared:.0f} distinct tokens per request on average, greedy, "
          f"max_tokens {args.max_tokens}, SmolLM2-135M fp32 on CPU")

    results = {}
    for label, enabled in (("cache on", True), ("cache off", False)):
        print(f"running with the prefix cache {label.split()[-1]} ...", flush=True)
        results[label] = result = run(label, prompts, args.max_tokens, enable_prefix_caching=enabled)
        print(f"  {result.seconds:.1f}s, {result.prompt_tokens_computed:,} prompt tokens computed")
    print(f"load average {os.getloadavg()[0]:.1f} at end")

    on, off = results["cache on"], results["cache off"]
    figures = {label: describe(result, shared) for label, result in results.items()}
    same = sum(a == b for a, b in zip(on.outputs, off.outputs, strict=True))
    print()
    for label in ("cache off", "cache on"):
        print(f"{label}:")
        for name, value in figures[label].items():
            print(f"  {name:<34} {value}")
    print("ratios (off / on):")
    fewer = off.prompt_tokens_computed / on.prompt_tokens_computed
    ttft_p50 = statistics.median(off.ttfts) / statistics.median(on.ttfts)
    print(f"  prompt tokens computed             {fewer:.1f}x fewer")
    print(f"  end-to-end speed-up                {off.seconds / on.seconds:.2f}x")
    print(f"  TTFT p50 / p99                     {ttft_p50:.1f}x / "
          f"{percentile(off.ttfts, 99) / percentile(on.ttfts, 99):.1f}x lower")
    print(f"greedy outputs identical with and without the cache: {same}/{len(prompts)}")

    on_figures = figures["cache on"]
    served = on_figures["shared-prompt tokens from cache"]
    speedup = off.seconds / on.seconds
    print()
    print(f"| {len(prompts)} requests, {shared}-token shared prefix, max_tokens {args.max_tokens}, "
          f"SmolLM2-135M fp32 CPU, {torch.get_num_threads()} thread(s) | cache off | cache on | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| prompt tokens computed | {off.prompt_tokens_computed:,} | {on.prompt_tokens_computed:,} | "
          f"{fewer:.1f}x fewer |")
    token_rate = on_figures["prefix-cache hit rate (tokens)"]
    block_rate = on_figures["prefix-cache hit rate (blocks)"]
    print(f"| prefix-cache hit rate (tokens / blocks) | n/a | {token_rate} / {block_rate} | |")
    print(f"| shared-prompt tokens served from cache (target >= 90%) | 0% | {served} | |")
    print(f"| total time (s) (target >= 3x faster) | {off.seconds:.1f} | {on.seconds:.1f} | "
          f"{speedup:.2f}x faster |")
    for name, q in (("TTFT p50 (s, incl. queueing)", 50), ("TTFT p99 (s, incl. queueing)", 99)):
        a, b = percentile(off.ttfts, q), percentile(on.ttfts, q)
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.1f}x lower |")


if __name__ == "__main__":
    main()
