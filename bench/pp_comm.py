"""Per-decode-step cost of pipeline parallelism on CPU (gloo): stage-to-stage transfers and the bubble.

For each model (a tiny random Llama built with tests/fixtures/tiny_models, and SmolLM2 unless --no-smollm2),
--num-seqs greedy requests are prefilled, then --steps decode steps run with pipeline_parallel_size=1 and
with --pp stages, the latter once with one micro-batch per step (no overlap) and once with the default
(pp micro-batches, GPipe-style). For every decode-only step rank 0 records
(batchinfer.engine.parallel.pp_stage.PIPE_STATS):
  - step: the whole execute_model call on rank 0;
  - stage 0: rank 0's own forward over its layers, all micro-batches;
  - send: encoding the layouts and posting the sends (layouts, hidden states);
  - wait: rank 0 waiting for the last stage's logits after its last micro-batch: stage 0 idle, its
    share of the pipeline bubble (bubble = wait / step). A pipeline of P equal stages and M micro-batches
    idles (P - 1) / (M + P - 1) of a step at best ('ideal').
The first step, which prefills every prompt at once (about 10 x --prompt-repeat tokens each), is timed
too ('prefill'): a compute-bound step, where micro-batches overlap instead of re-reading weights.
A pure send/recv microbenchmark (two idle processes ping-ponging one micro-batch's [tokens, hidden] fp32
hidden states) gives the transfer time of one stage hop without any waiting ('hop').

    .venv/bin/python bench/pp_comm.py                 # tiny + SmolLM2, pp=2, 8 sequences, 24 steps
    .venv/bin/python bench/pp_comm.py --no-smollm2 --num-seqs 32
    .venv/bin/python bench/pp_comm.py --prompt-repeat 6      # 8 prompts of ~60 tokens: a 500-token prefill
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.fixtures

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from batchinfer.engine import LLM, SamplingParams  # noqa: E402
from batchinfer.engine.parallel.pp_stage import PIPE_STATS  # noqa: E402


def measure_engine(
    model: str, pp: int, micro_batches: int | None, num_seqs: int, steps: int, repeat: int
) -> dict[str, float]:
    """Median per-decode-step milliseconds on rank 0 (step, stage 0, send, wait), and the prefill step's."""
    llm = LLM(model, device="cpu", dtype="float32", pipeline_parallel_size=pp, max_model_len=512)
    runner = llm.engine.model_runner
    if pp > 1:
        assert type(runner).__name__ == "PipelineParallelRunner", "the engine did not build a pipeline"
        if micro_batches is not None:  # forced: split every step, however small
            runner.num_micro_batches = micro_batches
            runner.min_micro_batch_tokens = 1
    inner_execute = runner.execute_model
    samples: list[dict[str, float]] = []
    prefills: list[float] = []

    def timed_execute(scheduled, logits_counts=None, **options):
        before = dataclasses.replace(PIPE_STATS)
        start = time.perf_counter()
        logits = inner_execute(scheduled, logits_counts, **options)
        elapsed = time.perf_counter() - start
        if scheduled and all(n > 1 for _, n in scheduled):
            prefills.append(elapsed)
        if scheduled and all(n == 1 for _, n in scheduled):
            samples.append({"step": elapsed, "stage0": PIPE_STATS.stage_s - before.stage_s,
                            "send": PIPE_STATS.send_s - before.send_s,
                            "wait": PIPE_STATS.logits_wait_s - before.logits_wait_s})
        return logits

    runner.execute_model = timed_execute
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        prompts = [f"Item {i}: " + "the quick brown fox jumps over the lazy dog " * repeat
                   for i in range(num_seqs)]
        llm.generate(prompts, params)
    finally:
        llm.close()
    samples = samples[3:]  # warm-up
    figures = {key: statistics.median(s[key] for s in samples) * 1000 for key in samples[0]}
    figures["prefill"] = statistics.median(prefills) * 1000 if prefills else float("nan")
    return figures


def _hop_worker(rank: int, port: int, shape: tuple[int, int], reps: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.randn(shape)
    times = []
    for i in range(reps + 10):
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, dst=1)
            dist.recv(tensor, src=1)
        else:
            dist.recv(tensor, src=0)
            dist.send(tensor, dst=0)
        if i >= 10:
            times.append((time.perf_counter() - start) / 2)
    if rank == 0:
        out.put(statistics.median(times) * 1000)
    dist.destroy_process_group()


def pure_hop_ms(shape: tuple[int, int], reps: int = 50) -> float:
    """Milliseconds for one send of a `shape` fp32 tensor between two idle processes (half a ping-pong)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hop_worker, args=(r, port, shape, reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--no-smollm2", action="store_true")
    parser.add_argument("--prompt-repeat", type=int, default=2,
                        help="the prompts repeat a 10-token sentence this often (prefill size)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from batchinfer.engine.model_files import load_hf_config, resolve_model_path
    from tests.fixtures.tiny_models import build_tiny_model

    models = [("tiny-llama", str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama")))]
    if not args.no_smollm2:
        models.append(("smollm2-135m", "smollm2-135m-instruct"))
    print(f"CPU gloo, {os.cpu_count()} cores, 1 thread per rank, {args.num_seqs} sequences decoding, "
          f"median of {args.steps - 3} decode steps (ms on rank 0); load {os.getloadavg()[0]:.2f}")
    print(f"{'model':<14}{'pp':>3}{'mb':>4}{'step':>9}{'stage0':>8}{'send':>7}{'wait':>8}{'bubble':>8}"
          f"{'ideal':>7}{'hop':>7}{'vs pp1':>8}{'prefill':>9}{'vs pp1':>8}")
    for name, model in models:
        hf_config = load_hf_config(resolve_model_path(model))
        if hf_config.num_hidden_layers < args.pp:
            continue
        single = measure_engine(model, 1, None, args.num_seqs, args.steps, args.prompt_repeat)
        print(f"{name:<14}{1:>3}{1:>4}{single['step']:>9.2f}{'-':>8}{'-':>7}{'-':>8}{'-':>8}{'-':>7}{'-':>7}"
              f"{'1.00x':>8}{single['prefill']:>9.1f}{'1.00x':>8}")
        for micro in (1, args.pp):
            multi = measure_engine(model, args.pp, micro, args.num_seqs, args.steps, args.prompt_repeat)
            ideal = (args.pp - 1) / (micro + args.pp - 1)
            hop = pure_hop_ms((max(1, args.num_seqs // micro), hf_config.hidden_size))
            print(f"{name:<14}{args.pp:>3}{micro:>4}{multi['step']:>9.2f}{multi['stage0']:>8.2f}"
                  f"{multi['send']:>7.2f}{multi['wait']:>8.2f}{multi['wait'] / multi['step']:>8.0%}"
                  f"{ideal:>7.0%}{hop:>7.3f}{single['step'] / multi['step']:>7.2f}x{multi['prefill']:>9.1f}"
                  f"{single['prefill'] / multi['prefill']:>7.2f}x")
    print("mb = micro-batches per step; bubble = wait / step (stage 0 idle); ideal = (P-1)/(M+P-1); "
          "hop = one micro-batch's hidden states sent between two idle processes; "
          "'vs pp1' = pp1 step / ppN step; prefill = the first step (every prompt at once).")


if __name__ == "__main__":
    main()
