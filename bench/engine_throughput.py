"""Offline generation throughput: our engine at each precision beside its peers, one workload, one run.

Workload (issue 21): N chat prompts on SmolLM2-135M-Instruct (the `smollm2-135m-instruct` alias), greedy,
stop at EOS (or --ignore-eos), per-request max_tokens spread deterministically over
[--min-tokens, --max-tokens]; every system gets the same token ids and budgets, and the tokens each one
actually produced are counted (bench/chat_workload.py). Runs, one after another:
  1. transformers `generate` in static padded batches (unless --skip-static),
  2. transformers continuous batching (`init_continuous_batching` / add_request, the engine behind
     `generate_batch`, each request with its own max_new_tokens), fp32,
  3. batchinfer (batchinfer.engine.llm.LLM) at fp32, bf16 and int8 (a precision the engine cannot run
     yet is skipped with the reason); on an AMX CPU one more fp32 row under float32_matmul_precision=high
     (bf16x3 GEMMs; generation's default there is highest), reported after the table (--skip-fp32-high),
  4. with --peers-python (the `make bench-peers` venv): OpenVINO GenAI's ContinuousBatchingPipeline at the
     same precisions, in a child process of that venv (bench/openvino_peer.py; IR exported once, cached).
For each: tok/s, tokens per CPU-second (the process's user + system time over the generation; the peer's
measured in its child), the ratio to the peer at the same precision, issue 21's targets met/missed, the
share of the fp32 matmul roofline, greedy agreement, and a markdown table for the README.

    make bench-peers                                                    # everything, peers included
    .venv/bin/python bench/engine_throughput.py --num-prompts 16 --max-tokens 48 --skip-static   # quick
"""

from __future__ import annotations

# OpenMP reads its wait policy when torch is imported: set the engine's defaults first (native/threads.py).
# Every system gets the same threads (--threads, default every usable core): the engine's one-fewer-when-
# loaded choice would hand our rows fewer threads than the peers' on a busy machine, so it is fixed here.
import os

from batchinfer.engine.native.threads import configure_openmp_env, usable_cores

os.environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))
OPENMP_APPLIED = configure_openmp_env()

import argparse  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from chat_workload import (  # noqa: E402
    MODEL_ALIAS,
    PRECISIONS,
    build_workload,
    engine_options,
    load_line,
    process_cpu_seconds,
    produced_tokens,
)
from openvino_peer import PEER_NAME, PEER_ROWS, ensure_export, run_peer  # noqa: E402

from batchinfer.engine.kv_cache_dtypes import KV_CACHE_DTYPES  # noqa: E402
from batchinfer.engine.native.cpu_features import cpu_has_amx_bf16  # noqa: E402

TARGET_VS_PEER = 1.2  # issue 21: >= 1.2x OpenVINO GenAI at each precision
FP32_HIGH = "fp32 high"  # the fp32 row under float32_matmul_precision=high (bf16x3 on AMX tiles)
TARGET_VS_TRANSFORMERS = 8.0  # issue 21: >= 8x transformers generate_batch
TRANSFORMERS_CB = "transformers generate_batch (continuous batching)"


@dataclass
class Result:
    name: str
    precision: str
    tokens: int
    seconds: float
    cpu_seconds: float
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_seconds if self.cpu_seconds > 0 else float("nan")

    def line(self) -> str:
        """One printed figure line."""
        return (f"  {self.name} [{self.precision}]: {self.tokens} tokens in {self.seconds:.1f}s = "
                f"{self.tokens_per_s:.1f} tok/s, {self.tokens_per_cpu_s:.1f} tok/CPU-s{self.note}")


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


def _until_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1]
    return ids


def run_static(model, tokenizer, prompts, budgets, batch_size: int, eos: frozenset[int] | None) -> Result:
    """transformers generate, left-padded static batches in arrival order."""
    from transformers import GenerationConfig

    outputs: list[list[int]] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cpu_start, start = process_cpu_seconds(), time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, wanted = prompts[first : first + batch_size], budgets[first : first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        config = GenerationConfig(max_new_tokens=max(wanted), do_sample=False,
                                  eos_token_id=sorted(eos) if eos else None, pad_token_id=pad)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        for row, n in zip(out, wanted, strict=True):
            generated = row[width : width + n].tolist()
            outputs.append(_until_eos(generated, eos) if eos else generated)
    seconds, cpu = time.perf_counter() - start, process_cpu_seconds() - cpu_start
    tokens = produced_tokens(outputs, budgets, eos or ())
    return Result("transformers generate (static batches)", "fp32", tokens, seconds, cpu, outputs)


def run_continuous(model, prompts, budgets, eos: frozenset[int] | None) -> Result:
    """transformers continuous batching with each request's own max_new_tokens."""
    from transformers import GenerationConfig

    eos_id: int | list[int] = sorted(eos) if eos else -1
    config = GenerationConfig(max_new_tokens=max(budgets), do_sample=False, eos_token_id=eos_id)
    results = {}
    batching = model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5)
    with batching as manager:
        cpu_start, start = process_cpu_seconds(), time.perf_counter()  # after warm-up, like generate_batch's
        ids = [manager.add_request(input_ids=p, request_id=f"req-{i}", max_new_tokens=n, eos_token_id=eos_id)
               for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped before finishing")
        seconds, cpu = time.perf_counter() - start, process_cpu_seconds() - cpu_start
    outputs = [list(results[i].generated_tokens) for i in ids]
    tokens = produced_tokens(outputs, budgets, eos or ())
    return Result(TRANSFORMERS_CB, "fp32", tokens, seconds, cpu, outputs)


def run_ours(prompts, budgets, precision: str, args, eos: frozenset[int],
             kv_cache_dtype: str = "auto", matmul_precision: str = "auto") -> Result | str:
    """batchinfer's engine on the same token ids; the Result, or why the precision was skipped."""
    from batchinfer.engine.llm import LLM
    from batchinfer.engine.sampling_params import SamplingParams

    options, skipped = engine_options(precision, args.int8_dtype, kv_cache_dtype)
    if skipped:
        return skipped
    if matmul_precision != "auto":
        options["float32_matmul_precision"] = matmul_precision
    try:
        llm = LLM(MODEL_ALIAS, max_num_seqs=args.max_num_seqs, device="cpu", **options)
    except (ValueError, NotImplementedError) as exc:
        return f"the engine refused {options}: {exc}"
    kv_format = getattr(llm.engine.model_runner, "kv_format", None)  # auto resolved (u8: bf16 / int8 on CPU)
    options["kv_cache"] = kv_format.name if kv_format is not None else "model dtype"
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=args.ignore_eos) for n in budgets]
    # Warm-up outside the timing (kernels built, allocator touched) on a prompt that shares no prefix block
    # with the workload, so the timed run's prefix-cache hits are only its own, as for the peers.
    llm.generate([list(reversed(prompts[0]))], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    cpu_start, start = process_cpu_seconds(), time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds, cpu = time.perf_counter() - start, process_cpu_seconds() - cpu_start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    llm.close()
    del llm
    gc.collect()
    note = f" ({', '.join(f'{k}={v}' for k, v in options.items())})"
    tokens = produced_tokens(outputs, budgets, eos)
    return Result("batchinfer", precision, tokens, seconds, cpu, outputs, note)


def run_peers(args, model_path: Path, prompts, budgets, eos: frozenset[int]) -> dict[str, Result | str]:
    """OpenVINO GenAI at each precision, each row in a child process of the peers venv."""
    from batchinfer.engine.model_files import cache_dir

    workload = {"prompts": prompts, "budgets": budgets, "eos_token_ids": sorted(eos),
                "ignore_eos": args.ignore_eos}
    rows: dict[str, Result | str] = {}
    for precision in PRECISIONS:
        weight_format, properties = PEER_ROWS[precision]
        try:
            ir_dir = ensure_export(Path(args.peers_python), model_path, weight_format, cache_dir())
            figures = run_peer(Path(args.peers_python), ir_dir, precision, workload, args.threads)
        except Exception as exc:  # the peer is an outside program: report its failure, keep the run
            rows[precision] = f"the peer failed: {exc}"
            continue
        outputs = figures["outputs"]
        note = (f" (IR {ir_dir}, {properties or figures.get('defaults', 'CPU defaults')}, "
                f"openvino {figures['openvino']}, compile {figures['load_seconds']:.1f}s)")
        rows[precision] = Result(PEER_NAME, precision, produced_tokens(outputs, budgets, eos),
                                 figures["seconds"], figures["cpu_seconds"], outputs, note)
    return rows


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


def _cell(result: Result | str | None) -> str:
    if isinstance(result, Result):
        return f"{result.tokens_per_s:.1f} ({result.tokens_per_cpu_s:.1f})"
    return "skipped" if result else ""


def _ratio(ours: Result | str | None, theirs: Result | str | None) -> float | None:
    if isinstance(ours, Result) and isinstance(theirs, Result):
        return ours.tokens_per_s / theirs.tokens_per_s
    return None


def report(args, ours: dict[str, Result | str], peers: dict[str, Result | str], transformers: list[Result],
           num_prompts: int) -> None:
    """Targets met/missed, then the README table."""
    cb = next((r for r in transformers if r.name == TRANSFORMERS_CB), None)
    print("\nissue 21 targets (same run):")
    for precision in PRECISIONS:
        ratio = _ratio(ours.get(precision), peers.get(precision))
        if ratio is None:
            why = ours.get(precision) if not isinstance(ours.get(precision), Result) else peers.get(precision)
            print(f"  {precision}: >= {TARGET_VS_PEER}x OpenVINO {precision}: not measured "
                  f"({why or 'no peer run'})")
        else:
            verdict = "met" if ratio >= TARGET_VS_PEER else "missed"
            print(f"  {precision}: >= {TARGET_VS_PEER}x OpenVINO {precision}: {ratio:.2f}x, {verdict}")
    if cb is not None:
        for precision in PRECISIONS:
            ratio = _ratio(ours.get(precision), cb)
            if ratio is not None:
                verdict = "met" if ratio >= TARGET_VS_TRANSFORMERS else "missed"
                print(f"  {precision}: >= {TARGET_VS_TRANSFORMERS:.0f}x {TRANSFORMERS_CB}: {ratio:.2f}x, "
                      f"{verdict}")
    stop = "ignore_eos" if args.ignore_eos else "stop at EOS"
    print(f"\n| {num_prompts} prompts, max_tokens {args.min_tokens}..{args.max_tokens}, greedy, {stop}, "
          f"SmolLM2-135M, {args.threads} threads: tok/s (tok/CPU-s) | fp32 | bf16 | int8 |")
    print("|---|---:|---:|---:|")
    print("| **batchinfer** | " + " | ".join(f"**{_cell(ours.get(p))}**" for p in PRECISIONS) + " |")
    if peers:
        print(f"| {PEER_NAME} (fp32: f32 compute + KV; bf16: its CPU defaults, bf16 compute where the CPU "
              "has it + u8 KV; int8: int8 weights) | "
              + " | ".join(_cell(peers.get(p)) for p in PRECISIONS) + " |")
        ratios = [_ratio(ours.get(p), peers.get(p)) for p in PRECISIONS]
        print(f"| batchinfer / OpenVINO (target >= {TARGET_VS_PEER}x) | "
              + " | ".join(f"{r:.2f}x" if r is not None else "" for r in ratios) + " |")
    for result in transformers:
        print(f"| {result.name} | {_cell(result)} | | |")
    if cb is not None:
        ratios = [_ratio(ours.get(p), cb) for p in PRECISIONS]
        print(f"| batchinfer / transformers generate_batch (target >= {TARGET_VS_TRANSFORMERS:.0f}x) | "
              + " | ".join(f"{r:.2f}x" if r is not None else "" for r in ratios) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true", help="generate every budgeted token")
    parser.add_argument("--hf-batch-size", type=int, default=32,
                        help="static batch size of transformers generate")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="our engine's running batch limit")
    parser.add_argument("--threads", type=int, default=usable_cores(),
                        help="threads of every system (torch's and the peer's INFERENCE_NUM_THREADS; "
                             "default: the usable cores)")
    parser.add_argument("--precision", action="append", choices=PRECISIONS,
                        help="batchinfer precisions to run (repeatable; default: all)")
    parser.add_argument("--kv-cache-dtype", action="append",
                        choices=list(KV_CACHE_DTYPES),
                        help="KV cache dtype of our rows (repeatable: each precision runs once per value; "
                             "default auto; rows other than auto are listed as <precision>+kv-<dtype>)")
    parser.add_argument("--int8-dtype", default="auto", help="compute dtype of the int8 row")
    parser.add_argument("--peers-python",
                        help="python of the peers venv (make bench-peers): adds OpenVINO GenAI")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-fp32-high", action="store_true",
                        help="on an AMX CPU, skip the extra fp32 row under float32_matmul_precision=high")
    parser.add_argument("--skip-continuous", action="store_true")
    args = parser.parse_args()
    if args.min_tokens > args.max_tokens:
        parser.error("--min-tokens must be <= --max-tokens")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.models.resolved_model import resolve_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    resolved = resolve_model(EngineConfig(model=MODEL_ALIAS))
    path, tokenizer, model_eos = resolved.path, resolved.tokenizer, resolved.eos_token_ids
    eos = None if args.ignore_eos else model_eos
    prompts, budgets = build_workload(tokenizer, args.num_prompts, args.min_tokens, args.max_tokens)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"threads {args.threads} (OpenMP defaults set: {OPENMP_APPLIED or 'none, all were in the env'})")
    print(f"start: {load_line()}")
    print(f"workload: {len(prompts)} chat prompts ({sum(map(len, prompts))} prompt tokens), "
          f"max_tokens {args.min_tokens}..{args.max_tokens} (at most {sum(budgets)} tokens), greedy, "
          f"{'ignore_eos' if args.ignore_eos else f'stop at EOS {sorted(model_eos)}'}")
    roofline = matmul_gflops()
    print(f"fp32 matmul roofline: {roofline:.1f} GFLOP/s")

    transformers: list[Result] = []
    if not (args.skip_static and args.skip_continuous):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if not args.skip_static:
            transformers.append(run_static(model, tokenizer, prompts, budgets, args.hf_batch_size, eos))
            print(transformers[-1].line())
        if not args.skip_continuous:
            transformers.append(run_continuous(model, prompts, budgets, eos))
            print(transformers[-1].line())
        del model
        gc.collect()
    ours: dict[str, Result | str] = {}
    for precision in args.precision or PRECISIONS:
        for kv in args.kv_cache_dtype or ["auto"]:
            key = precision if kv == "auto" else f"{precision}+kv-{kv}"  # auto rows: compared to the peers
            ours[key] = run_ours(prompts, budgets, precision, args, model_eos, kv)
            result = ours[key]
            print(result.line() if isinstance(result, Result)
                  else f"  batchinfer [{key}]: skipped: {result}")
    if not args.skip_fp32_high and "fp32" in (args.precision or PRECISIONS) and cpu_has_amx_bf16():
        # generation's opt-in on AMX CPUs (auto is highest there): reported beside the table, not in it
        result = run_ours(prompts, budgets, "fp32", args, model_eos, matmul_precision="high")
        if isinstance(result, Result):
            result = replace(result, precision=FP32_HIGH)  # its lines say which fp32 row it is
        ours[FP32_HIGH] = result
        print(result.line() if isinstance(result, Result)
              else f"  batchinfer [{FP32_HIGH}]: skipped: {result}")
    peers: dict[str, Result | str] = {}
    if args.peers_python:
        peers = run_peers(args, path, prompts, budgets, model_eos)
        for precision, result in peers.items():
            print(result.line() if isinstance(result, Result) else f"  {PEER_NAME} [{precision}]: {result}")
    print(f"end: {load_line()}")

    fp32 = ours.get("fp32")
    if isinstance(fp32, Result):
        num_params = count_params(path)
        achieved = 2 * num_params * fp32.tokens_per_s / 1e9
        print(f"batchinfer fp32: {achieved:.1f} GFLOP/s (2 x {num_params / 1e6:.1f}M params x tokens/s) = "
              f"{achieved / roofline:.1%} of the {roofline:.1f} GFLOP/s fp32 matmul roofline")
        cb = next((r for r in transformers if r.name == TRANSFORMERS_CB), None)
        if cb is not None:
            print(f"greedy agreement, batchinfer fp32 vs transformers: {agreement(fp32.outputs, cb.outputs)}")
        if isinstance(peers.get("fp32"), Result):
            print(f"greedy agreement, batchinfer fp32 vs OpenVINO fp32: "
                  f"{agreement(fp32.outputs, peers['fp32'].outputs)}")
    report(args, ours, peers, transformers, len(prompts))
    high = ours.get(FP32_HIGH)
    if isinstance(high, Result):
        cb = next((r for r in transformers if r.name == TRANSFORMERS_CB), None)
        ratios = (("OpenVINO fp32", _ratio(high, peers.get("fp32"))), (TRANSFORMERS_CB, _ratio(high, cb)),
                  ("batchinfer fp32 (highest)", _ratio(high, ours.get("fp32"))))
        print(f"\nbatchinfer {FP32_HIGH}: {_cell(high)} tok/s (tok/CPU-s); "
              + "; ".join(f"{ratio:.2f}x {name}" for name, ratio in ratios if ratio is not None))
        for name, other in (("transformers", cb), ("batchinfer fp32 (highest)", ours.get("fp32"))):
            if isinstance(other, Result):
                print(f"greedy agreement, batchinfer {FP32_HIGH} vs {name}: "
                      f"{agreement(high.outputs, other.outputs)}")


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
