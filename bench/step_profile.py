"""Where a step's time goes, and throughput per precision, for the engine alone (SPEED's tool, issue 21).

Runs the issue-21 workload (N chat prompts on SmolLM2-135M-Instruct, per-request max_tokens spread over
[--min-tokens, --max-tokens], greedy, stop at EOS unless --ignore-eos) through batchinfer.engine.LLM once
per --config (dtype[:quantization][+flag...], e.g. float32 bfloat16 float32:int8), alternating --rounds
times so the configurations share the same window, and prints tok/s, tokens per CPU-second (os.times) and
load. Flags rebuild the engine as it was before issue 21's speed work, for paired A/B runs: +aten (plain
F.linear, no oneDNN/int8 packing), +onednn / +panel (that dense GEMM; default: BATCHINFER_CPU_LINEAR=auto;
the panel GEMM is not a dispatcher op, so --profile counts its time under "other"), +nofuse (torch ops
instead of the fused norm/rotary/SiLU kernels), +sdpa (decode attention through the padded SDPA path
instead of the native kernel, over the configuration's cache: u8 codes under bfloat16 unless +kv=bf16),
+pystep (the Python layer loop instead of issue 34's native step, csrc/decoder_stack.cpp),
+kv=<kv_cache_dtype> (the KV cache: int8, u8, fp8_e4m3, bf16, fp32; default auto, u8 under bfloat16 or int8
weights on CPU),
+int8=<engine> (int8's GEMM: fbgemm or onednn; default auto, oneDNN's on AMX CPUs),
+high (float32_matmul_precision "high": float32 GEMMs in bf16x3 on AMX tiles; default highest, as generation's
auto), +noscreen (a float32 head's greedy rows as full float32 logits, not screened by its bf16 GEMM:
layers/greedy_head.py).
--profile adds a torch.profiler table of one run of each configuration, grouped into GEMMs, attention,
elementwise/norm/rotary and the rest.

    .venv/bin/python bench/step_profile.py --configs float32 bfloat16 float32:int8 --num-prompts 96
    .venv/bin/python bench/step_profile.py --configs float32 --num-prompts 32 --max-tokens 64 --profile
    .venv/bin/python bench/step_profile.py --configs bfloat16 bfloat16+kv=u8 --num-prompts 96 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_workload import build_workload  # noqa: E402  (the shared workload definition, PEERS)

# torch.profiler op name fragments -> the bucket a step's time is reported in
BUCKETS = [
    ("gemm", ("aten::linear", "aten::addmm", "aten::mm", "_weight_int8pack_mm", "_weight_int4pack",
              "mkldnn_linear", "_linear_pointwise", "quantized::linear_dynamic", "aten::matmul")),
    ("attention", ("paged_decode_attention", "scaled_dot_product", "index_copy", "index_select")),
    ("norm/rotary/elementwise", ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt",
                                 "aten::cat", "aten::silu", "aten::sub", "aten::to", "aten::copy_",
                                 "aten::neg", "rms_norm", "aten::embedding", "aten::div")),
]


def run_once(llm, prompts, params) -> tuple[int, float, float]:
    """(generated tokens, wall seconds, CPU seconds of this process) of one generate call."""
    before, start = os.times(), time.perf_counter()
    outs = llm.generate(prompts, params)
    wall, after = time.perf_counter() - start, os.times()
    cpu = (after.user - before.user) + (after.system - before.system)
    return sum(len(o.outputs[0].token_ids) for o in outs), wall, cpu


def bucket_table(prof) -> str:
    """Self CPU time of the profiled run, grouped into BUCKETS (top-level ops only, no double count)."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        name = event.key
        for bucket, fragments in BUCKETS:
            if any(f in name for f in fragments):
                totals[bucket] += event.self_cpu_time_total
                break
        else:
            totals["other (python, sampler, small ops)"] += event.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return "\n".join(f"    {k:38s} {v / 1e6:7.2f}s  {v / whole:6.1%}" for k, v in
                     sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> None:
    """Parse arguments, build one LLM per configuration, run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["float32"], help="dtype[:quantization] entries")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from batchinfer.engine.llm import LLM
    from batchinfer.engine.model_files import resolve_model_path
    from batchinfer.engine.models.loader import load_tokenizer
    from batchinfer.engine.sampling_params import SamplingParams

    tokenizer = load_tokenizer(resolve_model_path(args.model))
    prompts, budgets = build_workload(tokenizer, args.num_prompts, args.min_tokens, args.max_tokens)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=args.ignore_eos) for n in budgets]
    print(f"workload: {len(prompts)} prompts, max_tokens {args.min_tokens}..{args.max_tokens}, greedy, "
          f"{'ignore_eos' if args.ignore_eos else 'stop at EOS'}, {args.threads} threads, "
          f"load {os.getloadavg()[0]:.2f} at start")
    from batchinfer.engine.layers import cpu_attention, weight_packing
    from batchinfer.engine.worker import native_step

    llms = {}
    for entry in args.configs:
        spec, *flags = entry.split("+")
        dtype, _, quant = spec.partition(":")
        linear = next((mode for mode in ("aten", "onednn", "panel") if mode in flags), "auto")
        os.environ[weight_packing.CPU_LINEAR_ENV] = linear
        os.environ[native_step.NATIVE_STEP_ENV] = "0" if "pystep" in flags else "1"
        cpu_attention._FUSED_OFF = "nofuse" in flags  # before the build: the native step needs the fused ops
        kv_cache_dtype = next((flag.removeprefix("kv=") for flag in flags if flag.startswith("kv=")), "auto")
        os.environ[weight_packing.INT8_GEMM_ENV] = next(
            (flag.removeprefix("int8=") for flag in flags if flag.startswith("int8=")), "auto")
        llms[entry] = LLM(args.model, dtype=dtype, device="cpu", quantization=quant or None,
                          kv_cache_dtype=kv_cache_dtype,
                          float32_matmul_precision="high" if "high" in flags else "highest")
        if "sdpa" in flags:
            llms[entry].engine.model_runner.native_decode = False
        if "noscreen" in flags:
            llms[entry].engine.model_runner.greedy_head = None
        cpu_attention._FUSED_OFF = "nofuse" in flags
        run_once(llms[entry], prompts[:4], params[:4])  # warm-up: kernels built, oneDNN primitives cached
    figures: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for _ in range(args.rounds):
        for entry, llm in llms.items():
            cpu_attention._FUSED_OFF = "nofuse" in entry.split("+")
            figures[entry].append(run_once(llm, prompts, params))
            tokens, wall, cpu = figures[entry][-1]
            print(f"  {entry:18s} {tokens:6d} tokens {wall:6.2f}s  {tokens / wall:7.1f} tok/s  "
                  f"{tokens / cpu:7.1f} tok/CPU-s  load {os.getloadavg()[0]:.2f}", flush=True)
    base = max(t / w for t, w, _ in figures[args.configs[0]])
    for entry, runs in figures.items():
        best = max(t / w for t, w, _ in runs)
        print(f"best {entry:18s} {best:7.1f} tok/s  {best / base:5.2f}x {args.configs[0]}")
        head = llms[entry].engine.model_runner.greedy_head
        if head is not None and head.screened_rows:
            print(f"     {entry:18s} greedy head: {head.screened_rows} rows screened, "
                  f"{head.candidates / head.screened_rows:.2f} candidates per row recomputed in float32")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile, record_function

        kernel = cpu_attention.paged_decode_attention

        def recorded(*args, **kwargs):  # the extension call is no dispatcher op: name it for the table
            with record_function("paged_decode_attention"):
                return kernel(*args, **kwargs)

        cpu_attention.paged_decode_attention = recorded  # seen by +pystep runs (the native step calls C++)
        for entry, llm in llms.items():
            cpu_attention._FUSED_OFF = "nofuse" in entry.split("+")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                tokens, wall, _ = run_once(llm, prompts, params)
            print(f"profile {entry}: {tokens} tokens in {wall:.2f}s (profiled)")
            print(bucket_table(prof))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
