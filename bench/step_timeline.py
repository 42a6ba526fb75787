"""Where a run's wall time goes between the engine's bookkeeping and the model, by step kind and batch size.

Runs the `make bench-peers` workload (bench/chat_workload.py: 96 chat prompts on SmolLM2-135M-Instruct,
greedy, max_tokens 16..256) through batchinfer.engine.LLM at one precision, timing every Engine.step and
every ModelRunner.execute_model call, and prints: the wall time outside the model (scheduling, sampling
bookkeeping, detokenizing), the steps grouped as prefill/mixed or decode by batch size (16-wide buckets),
and each group's ms per step and CPUs busy (process CPU time over wall time; OpenMP's spin-waits count as
busy). Compare a group's ms with the GEMM time of its batch size to see what the rest of a step costs
(attention, norms, barriers).

    .venv/bin/python bench/step_timeline.py --precision bf16
"""

from __future__ import annotations

import os

from batchinfer.engine.native.threads import configure_openmp_env, usable_cores

os.environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))
configure_openmp_env()  # before torch is imported (OpenMP reads its wait policy then)

import argparse  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from chat_workload import PRECISIONS, build_workload, engine_options, load_line  # noqa: E402


def cpu_seconds() -> float:
    """This process's user + system CPU time so far, every thread (finer than os.times' 10 ms ticks)."""
    return time.process_time()


def main() -> None:
    """Run the workload once at --precision and print the time outside the model and ms per step group."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()

    from batchinfer.engine.llm import LLM
    from batchinfer.engine.sampling_params import SamplingParams

    options, why_not = engine_options(args.precision)
    if why_not:
        raise SystemExit(f"{args.precision}: {why_not}")
    llm = LLM(args.model, max_num_seqs=256, **options)
    prompts, budgets = build_workload(llm.get_tokenizer(), args.num_prompts, 16, 256)
    engine, runner = llm.engine, llm.engine.model_runner
    steps: list[tuple[int, int, float, float]] = []  # (sequences, tokens, seconds, CPU-s) per execute_model
    totals = {"step": 0.0}
    execute, step = runner.execute_model, engine.step

    def timed_execute(scheduled: Sequence, logits_counts: Sequence[int] | None = None, **options):  # type: ignore[no-untyped-def]
        start, cpu_start = time.perf_counter(), cpu_seconds()
        logits = execute(scheduled, logits_counts, **options)  # argmax_only_rows passes through
        steps.append((len(scheduled), sum(n for _, n in scheduled), time.perf_counter() - start,
                      cpu_seconds() - cpu_start))
        return logits

    def timed_step(**kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        outputs = step(**kwargs)
        totals["step"] += time.perf_counter() - start
        return outputs

    runner.execute_model = timed_execute  # type: ignore[method-assign]
    engine.step = timed_step  # type: ignore[method-assign]
    greedy = [SamplingParams(max_tokens=budget, temperature=0) for budget in budgets]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy[:4], use_tqdm=False)  # warm-up
    steps.clear()
    totals["step"] = 0.0
    print(f"start: {load_line()}")
    cpu0, start = cpu_seconds(), time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_model = sum(seconds for _, _, seconds, _ in steps)
    print(f"{args.precision}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s, "
          f"{tokens / cpu:.1f} tok/CPU-s; {len(steps)} steps; in the model {in_model:.2f} s, "
          f"outside it {totals['step'] - in_model:.2f} s")
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0])
    for sequences, new_tokens, seconds, cpu_used in steps:
        low = sequences // 16 * 16
        name = "prefill/mixed" if new_tokens != sequences else f"decode {low:3d}-{low + 15}"
        group = groups[name]
        group[0] += 1
        group[1] += seconds
        group[2] += new_tokens
        group[3] += cpu_used
    for name in sorted(groups):
        count, seconds, new_tokens, cpu_used = groups[name]
        print(f"  {name:14s} steps {int(count):4d}  {seconds:6.2f} s  {seconds / count * 1e3:7.1f} ms/step  "
              f"{cpu_used / seconds:4.2f} CPUs busy  tokens {int(new_tokens)}")
    print(f"end: {load_line()}")


if __name__ == "__main__":
    main()
