"""The chat workload the engine benches share (torch-free, so a bench can set OpenMP defaults first).

N chat prompts on SmolLM2-135M-Instruct, templated to token ids, each with a deterministic max_tokens in
[min_tokens, max_tokens]; every system gets the same ids and budgets. `produced_tokens` counts what a
system actually generated, the same way for all of them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Container, Sequence

MODEL_ALIAS = "smollm2-135m-instruct"
PRECISIONS = ("fp32", "bf16", "int8")
TOPICS = [
    "the ocean", "sourdough bread", "a mountain village", "rust on old bikes", "learning Python", "jazz",
    "the moon landing", "old oak trees", "morning coffee", "a lazy cat", "trains in winter", "honey bees",
    "a lighthouse keeper", "chess openings", "desert nights", "a city library",
]
TASKS = [
    "Write a short story about {}.", "Explain {} to a ten-year-old.", "Give me five facts about {}.",
    "Write a poem about {}.", "Describe {} in detail.", "What should I know about {}?",
]


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


def produced_tokens(outputs: Sequence[Sequence[int]], budgets: Sequence[int], eos: Container[int]) -> int:
    """Generated tokens, counting a stripped EOS: an output shorter than its budget ended on one.

    Some systems return the EOS token, others drop it; either way it took a step to produce.
    """
    total = 0
    for ids, budget in zip(outputs, budgets, strict=True):
        ended_on_stripped_eos = len(ids) < budget and (not ids or ids[-1] not in eos)
        total += len(ids) + int(ended_on_stripped_eos)
    return total


def process_cpu_seconds() -> float:
    """User + system CPU time of this process so far, all its threads."""
    times = os.times()
    return times.user + times.system


def load_line() -> str:
    """`uptime` as it prints, plus the runnable/total tasks right now (from /proc/loadavg)."""
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        one, five, fifteen = os.getloadavg()
        uptime = f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f}"
    try:
        with open("/proc/loadavg") as f:
            running = f.read().split()[3]
    except OSError:
        running = "?"
    return f"uptime: {uptime} (running/total tasks now {running})"


def engine_options(precision: str, int8_dtype: str = "auto",
                   kv_cache_dtype: str = "auto") -> tuple[dict, str | None]:
    """LLM options of a precision row (and KV cache dtype), or ({}, why the engine cannot run it yet)."""
    from batchinfer.engine.config import EngineConfig

    kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    if precision == "fp32":
        return {"dtype": "float32", **kv}, None
    if precision == "bf16":
        return {"dtype": "bfloat16", **kv}, None
    if "quantization" not in EngineConfig.field_names():
        return {}, "EngineConfig has no `quantization` option yet"
    return {"quantization": "int8", "dtype": int8_dtype, **kv}, None
