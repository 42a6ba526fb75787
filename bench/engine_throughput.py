"""Offline generation throughput: our engine vs transformers, one workload, one run, same machine.

Workload: N chat prompts on SmolLM2-135M-Instruct (the `smollm2-135m-instruct` alias), fp32, greedy,
ignore_eos, per-request max_tokens spread deterministically over [--min-tokens, --max-tokens]. Runs
  1. transformers `generate` in static padded batches (each batch runs until its longest request is done),
  2. transformers continuous batching (`init_continuous_batching` / add_request, the engine behind
     `generate_batch`, with each request's own max_new_tokens),
  3. our engine (batchinfer.engine.llm.LLM),
and prints tokens/s of each (generated tokens that were asked for), our ratio to each, the share of the
machine's fp32 matmul roofline our run reaches (2 * params FLOPs per generated token vs a big torch.matmul
measured in the same run), greedy agreement with the continuous-batching outputs, and a markdown table.

    .venv/bin/python bench/engine_throughput.py                       # the full workload (128 prompts)
    .venv/bin/python bench/engine_throughput.py --num-prompts 16 --max-tokens 48   # quick
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from dataclasses import dataclass

import torch

TOPICS = [
    "the ocean", "sourdough bread", "a mountain village", "rust on old bikes", "learning Python", "jazz",
    "the moon landing", "old oak trees", "morning coffee", "a lazy cat", "trains in winter", "honey bees",
    "a lighthouse keeper", "chess openings", "desert nights", "a city library",
]
TASKS = [
    "Write a short story about {}.", "Explain {} to a ten-year-old.", "Give me five facts about {}.",
    "Write a poem about {}.", "Describe {} in detail.", "What should I know about {}?",
]


@dataclass
class Result:
    name: str
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def build_workload(tokenizer, num_prompts: int, min_tokens: int, max_tokens: int):
    """Chat prompts (token ids, templated) and their deterministic max_tokens."""
    prompts, budgets = [], []
    for i in range(num_prompts):
        task = TASKS[i % len(TASKS)].format(TOPICS[(i * 7) % len(TOPICS)])
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{task} (request {i})"}],
                                             tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
        budgets.append(min_tokens + (i * 37) % (max_tokens - min_tokens + 1))
    return prompts, budgets


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """Best-of fp32 GFLOP/s of one [size x size] @ [size x size] matmul (the machine's practical roofline)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def run_static(model, tokenizer, prompts, budgets, batch_size: int) -> tuple[Result, list[list[int]]]:
    """transformers generate, left-padded static batches in arrival order."""
    from transformers import GenerationConfig

    outputs: list[list[int]] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, wanted = prompts[first : first + batch_size], budgets[first : first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        config = GenerationConfig(max_new_tokens=max(wanted), do_sample=False, eos_token_id=None,
                                  pad_token_id=pad)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        outputs.extend(row[width : width + n].tolist() for row, n in zip(out, wanted, strict=True))
    seconds = time.perf_counter() - start
    return Result("transformers generate (static batches)", sum(budgets), seconds), outputs


def run_continuous(model, prompts, budgets) -> tuple[Result, list[list[int]]]:
    """transformers continuous batching with each request's own max_new_tokens, EOS disabled."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(budgets), do_sample=False, eos_token_id=-1)
    results = {}
    batching = model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5)
    with batching as manager:
        start = time.perf_counter()  # after warm-up, like generate_batch's own timing would be
        ids = [manager.add_request(input_ids=p, request_id=f"req-{i}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped before finishing")
        seconds = time.perf_counter() - start
    outputs = [list(results[i].generated_tokens) for i in ids]
    return Result("transformers continuous batching", sum(map(len, outputs)), seconds), outputs


def run_ours(prompts, budgets, max_num_seqs: int) -> tuple[Result, list[list[int]]]:
    """batchinfer's engine on the same token ids."""
    from batchinfer.engine.llm import LLM
    from batchinfer.engine.sampling_params import SamplingParams

    llm = LLM("smollm2-135m-instruct", max_num_seqs=max_num_seqs, dtype="float32", device="cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in budgets]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    return Result("batchinfer engine", sum(map(len, outputs)), seconds), outputs


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """Share of requests whose greedy outputs are identical, and of tokens before the first difference."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    prefix = 0
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            prefix += 1
    total = sum(len(b) for b in theirs)
    return f"{same}/{len(ours)} identical, {prefix / max(total, 1):.1%} of tokens before the first difference"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=32,
                        help="static batch size of transformers generate")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="our engine's running batch limit")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-continuous", action="store_true")
    args = parser.parse_args()
    if args.min_tokens > args.max_tokens:
        parser.error("--min-tokens must be <= --max-tokens")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from batchinfer.engine.loader import resolve_model_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts, budgets = build_workload(tokenizer, args.num_prompts, args.min_tokens, args.max_tokens)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} at start")
    print(f"workload: {len(prompts)} chat prompts ({sum(map(len, prompts))} prompt tokens), "
          f"max_tokens {args.min_tokens}..{args.max_tokens} ({sum(budgets)} tokens to generate), "
          "greedy, fp32, ignore_eos")
    roofline = matmul_gflops()
    print(f"fp32 matmul roofline: {roofline:.1f} GFLOP/s")

    results: list[Result] = []
    reference = None
    if not (args.skip_static and args.skip_continuous):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if not args.skip_static:
            result, _ = run_static(model, tokenizer, prompts, budgets, args.hf_batch_size)
            results.append(result)
            print(f"  {result.name}: {result.tokens} tokens in {result.seconds:.1f}s")
        if not args.skip_continuous:
            result, reference = run_continuous(model, prompts, budgets)
            results.append(result)
            print(f"  {result.name}: {result.tokens} tokens in {result.seconds:.1f}s")
        del model
    ours, our_outputs = run_ours(prompts, budgets, args.max_num_seqs)
    print(f"  {ours.name}: {ours.tokens} tokens in {ours.seconds:.1f}s")
    if ours.tokens != sum(budgets):
        print(f"WARNING: our engine generated {ours.tokens} tokens, {sum(budgets)} were asked for")
    num_params = count_params(path)
    achieved = 2 * num_params * ours.tokens / ours.seconds / 1e9
    print(f"load average {os.getloadavg()[0]:.1f} at end")
    if reference is not None:
        print(f"greedy agreement with transformers continuous batching: {agreement(our_outputs, reference)}")

    print()
    print(f"| {len(prompts)} prompts, max_tokens {args.min_tokens}..{args.max_tokens}, SmolLM2-135M fp32, "
          f"{torch.get_num_threads()} threads | tokens/s | batchinfer speed-up |")
    print("|---|---:|---:|")
    for result in results:
        ratio = ours.tokens_per_s / result.tokens_per_s
        print(f"| {result.name} | {result.tokens_per_s:.1f} | {ratio:.2f}x |")
    print(f"| **batchinfer engine** | **{ours.tokens_per_s:.1f}** | 1.00x |")
    print()
    print(f"batchinfer: {achieved:.1f} GFLOP/s (2 x {num_params / 1e6:.1f}M params x tokens/s) = "
          f"{achieved / roofline:.1%} of the {roofline:.1f} GFLOP/s fp32 matmul roofline")


def count_params(path) -> int:
    """Parameters stored in the checkpoint (a tied head counted once, as the matmul it is)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118
                total += math.prod(checkpoint.get_slice(name).get_shape())
    return total


if __name__ == "__main__":
    main()
