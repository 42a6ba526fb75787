"""Quality of bf16 and int8 against fp32 on the bench workload (issue 21's quality figures).

For each precision beside fp32, on the chat workload of bench/engine_throughput.py (greedy, stop at EOS):
  - the share of requests whose greedy output is identical to fp32's,
  - the mean number of tokens before the first divergence (over all requests, and over the diverging ones),
  - the mean log-probability per token of a fixed text (the engine's prompt_logprobs, no prefix cache
    involved) and its relative delta to fp32's; targets: <= 1% bf16, <= 3% int8.
A precision the engine cannot run yet is skipped with the reason.
With --kv-cache-dtype (repeatable), the rows are instead KV cache dtypes (EngineConfig.kv_cache_dtype) at
the bf16 model dtype, against the bf16 cache (#34).

    .venv/bin/python bench/quality.py
    .venv/bin/python bench/quality.py --num-prompts 16 --max-tokens 64        # quick
    .venv/bin/python bench/quality.py --kv-cache-dtype int8 --kv-cache-dtype u8 --kv-cache-dtype fp8_e4m3
"""

from __future__ import annotations

from batchinfer.engine.native.threads import configure_openmp_env

configure_openmp_env()  # before torch is imported (engine/native/threads.py)

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402

from chat_workload import MODEL_ALIAS, build_workload, engine_options, load_line  # noqa: E402

# precision -> the largest relative delta of the fixed text's mean logprob vs fp32 (issue 21)
LOGPROB_TARGETS = {"bf16": 0.01, "int8": 0.03}
KV_LOGPROB_TARGET = 0.01  # a quantized KV cache vs the bf16 cache: within bf16's own budget vs fp32
# The fixed text: plain English prose of a few hundred tokens, nothing the model was asked to generate.
FIXED_TEXT = (
    "The lighthouse stood at the end of a long stone pier, its white paint flaking in the salt wind. Every "
    "evening the keeper climbed the spiral stairs, one hundred and twelve of them, to light the lamp and "
    "wind the clockwork that turned the great lens. Ships passing in the night saw its beam sweep across the "
    "water every ten seconds, a steady signal that the rocks were near and the harbour was close. In winter "
    "the storms came from the north, and waves broke over the pier so high that the keeper could not leave "
    "the tower for days. He kept a logbook of every ship he saw, the weather at each hour, and the oil the "
    "lamp burned. When the electric light replaced the oil lamp, the keeper stayed on for another year, "
    "because the machines still needed someone to watch them. Today the lighthouse runs on its own, and the "
    "logbooks sit in the town library, where children read about the storms and the ships that came home "
    "safely because a light was burning at the end of the pier. Bread is made from flour, water, salt and "
    "yeast; the dough rises as the yeast turns sugars into gas, and baking sets the crumb and browns the "
    "crust. A good loaf needs time more than skill: a slow rise in a cool kitchen gives the flavour that a "
    "quick one never will."
)


def divergence(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float, float]:
    """Share identical, mean tokens before the first divergence (all requests; diverging ones only)."""
    prefixes, diverging = [], []
    for a, b in zip(reference, other, strict=True):
        common = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            common += 1
        prefixes.append(common)
        if a != b:
            diverging.append(common)
    same = sum(a == b for a, b in zip(reference, other, strict=True)) / len(reference)
    mean_diverging = sum(diverging) / len(diverging) if diverging else float("nan")
    return same, sum(prefixes) / len(prefixes), mean_diverging


def run_precision(precision: str, prompts, budgets, text_ids: list[int], args):
    """(greedy outputs, mean logprob of the fixed text) at one precision, or the reason it was skipped."""
    from batchinfer.engine.llm import LLM
    from batchinfer.engine.sampling_params import SamplingParams

    if precision.startswith("kv:"):  # a KV cache dtype at the bf16 model dtype
        options, skipped = {"dtype": "bfloat16", "kv_cache_dtype": precision[3:]}, None
    else:
        options, skipped = engine_options(precision, args.int8_dtype)
    if skipped:
        return skipped
    try:
        llm = LLM(MODEL_ALIAS, device="cpu", **options)
    except (ValueError, NotImplementedError) as exc:
        return f"the engine refused {options}: {exc}"
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in budgets]
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    scored = llm.generate([text_ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    entries = scored.prompt_logprobs[1:]  # the first token has no predecessor
    logprobs = [entry[token].logprob for entry, token in zip(entries, text_ids[1:], strict=True)]
    llm.close()
    del llm
    gc.collect()
    return outputs, sum(logprobs) / len(logprobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--precision", action="append", choices=sorted(LOGPROB_TARGETS),
                        help="precisions to compare with fp32 (repeatable; default: all)")
    parser.add_argument("--kv-cache-dtype", action="append", choices=["bf16", "fp8_e4m3", "int8", "u8"],
                        help="compare KV cache dtypes with the bf16 cache instead (repeatable)")
    parser.add_argument("--int8-dtype", default="auto", help="compute dtype of the int8 row")
    args = parser.parse_args()

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.models.resolved_model import resolve_model

    tokenizer = resolve_model(EngineConfig(model=MODEL_ALIAS)).tokenizer
    prompts, budgets = build_workload(tokenizer, args.num_prompts, args.min_tokens, args.max_tokens)
    text_ids = tokenizer(FIXED_TEXT).input_ids
    print(f"start: {load_line()}")
    print(f"workload: {len(prompts)} chat prompts, max_tokens {args.min_tokens}..{args.max_tokens}, greedy, "
          f"stop at EOS; fixed text: {len(text_ids)} tokens")
    start = time.perf_counter()
    base = "kv:bf16" if args.kv_cache_dtype else "fp32"
    reference = run_precision(base, prompts, budgets, text_ids, args)
    assert not isinstance(reference, str), reference
    ref_outputs, ref_logprob = reference
    print(f"{base}: fixed-text mean logprob {ref_logprob:.4f}")
    rows = []
    kv_rows = [f"kv:{name}" for name in args.kv_cache_dtype or () if name != "bf16"]
    for precision in kv_rows or args.precision or list(LOGPROB_TARGETS):
        result = run_precision(precision, prompts, budgets, text_ids, args)
        if isinstance(result, str):
            print(f"{precision}: skipped: {result}")
            rows.append(f"| {precision} | skipped ({result}) | | | |")
            continue
        outputs, logprob = result
        same, mean_prefix, mean_diverging = divergence(ref_outputs, outputs)
        delta = abs(logprob - ref_logprob) / abs(ref_logprob)
        target = LOGPROB_TARGETS.get(precision, KV_LOGPROB_TARGET)
        verdict = "met" if delta <= target else "missed"
        print(f"{precision}: {same:.1%} identical greedy outputs; {mean_prefix:.1f} tokens before the first "
              f"divergence on average ({mean_diverging:.1f} over the diverging ones); fixed-text mean "
              f"logprob {logprob:.4f}, delta {delta:.2%} (target <= {target:.0%}: {verdict})")
        rows.append(f"| {precision} | {same:.1%} | {mean_prefix:.1f} ({mean_diverging:.1f}) | "
                    f"{logprob:.4f} vs {ref_logprob:.4f} | {delta:.2%} (<= {target:.0%}, {verdict}) |")
    print(f"end: {load_line()} ({time.perf_counter() - start:.0f}s)")
    print()
    print(f"| vs {base}, {len(prompts)} prompts, greedy | identical outputs | mean tokens before the first "
          "divergence (diverging only) | fixed-text mean logprob | relative delta (target) |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
