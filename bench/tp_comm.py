"""Per-decode-step communication cost of tensor parallelism on CPU (gloo): all-reduce + step broadcast.

For each model (a tiny random Llama built with tests/fixtures/tiny_models, and SmolLM2 unless --no-smollm2),
--num-seqs greedy requests are prefilled, then --steps decode steps run with tensor_parallel_size=--tp
(tiny) / --smollm2-tp, and the same with tp=1 (SmolLM2 has 9 query heads, so its smallest split is tp=3,
--smollm2-tp; on a 2-core machine its 3 ranks share 2 cores). For every decode-only step, rank 0 records
(from batchinfer.engine.parallel.distributed.COMM_STATS):
  - step: the whole execute_model call on rank 0 (broadcast + forward + logits gather);
  - all-reduce: time inside the all-reduces (embedding + one per o_proj and down_proj), INCLUDING waiting
    for the slower rank to arrive, so it also holds load imbalance, not just data movement;
  - gather: the logits gather of the vocab shards to rank 0;
  - broadcast: serializing the step layout into shared memory and setting the workers' events.
A pure all-reduce microbenchmark (tp processes doing nothing else, the same [num_seqs, hidden] fp32
tensor, same count per step) separates the data movement from the waiting.

    .venv/bin/python bench/tp_comm.py                 # tiny tp=2 + SmolLM2 tp=3, 8 sequences, 24 steps
    .venv/bin/python bench/tp_comm.py --no-smollm2 --num-seqs 32
"""

from __future__ import annotations

import argparse
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
from batchinfer.engine.parallel.distributed import COMM_STATS  # noqa: E402


def measure_engine(model: str, tp: int, num_seqs: int, steps: int) -> dict[str, float]:
    """Median per-decode-step milliseconds on rank 0: step, all-reduce, gather, broadcast, and counts."""
    llm = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=tp, max_model_len=512)
    engine = llm.engine
    runner = engine.model_runner
    inner_execute = runner.execute_model
    samples: list[dict[str, float]] = []

    def timed_execute(scheduled, logits_counts=None, **options):
        before = (COMM_STATS.all_reduce_s, COMM_STATS.all_reduce_calls, COMM_STATS.gather_s,
                  COMM_STATS.broadcast_s)
        start = time.perf_counter()
        logits = inner_execute(scheduled, logits_counts, **options)
        elapsed = time.perf_counter() - start
        if scheduled and all(n == 1 for _, n in scheduled):
            samples.append({
                "step": elapsed,
                "all_reduce": COMM_STATS.all_reduce_s - before[0],
                "calls": COMM_STATS.all_reduce_calls - before[1],
                "gather": COMM_STATS.gather_s - before[2],
                "broadcast": COMM_STATS.broadcast_s - before[3],
            })
        return logits

    runner.execute_model = timed_execute
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        prompts = [f"Item {i}: the quick brown fox jumps over the lazy dog number {i}"
                   for i in range(num_seqs)]
        llm.generate(prompts, params)
    finally:
        llm.close()
    samples = samples[3:]  # warm-up
    return {key: statistics.median(s[key] for s in samples) * (1 if key == "calls" else 1000)
            for key in samples[0]}


def _allreduce_worker(rank: int, world: int, port: int, shape: tuple[int, int], calls: int, reps: int,
                      out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensor = torch.randn(shape)
    for _ in range(10):
        dist.all_reduce(tensor)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times) * 1000)
    dist.destroy_process_group()


def pure_allreduce_ms(world: int, shape: tuple[int, int], calls: int, reps: int = 30) -> float:
    """Milliseconds for `calls` back-to-back all-reduces of a `shape` fp32 tensor among `world` idle ranks."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, port, shape, calls, reps, out))
             for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="for the tiny model (4 heads)")
    parser.add_argument("--smollm2-tp", type=int, default=3,
                        help="SmolLM2 has 9 heads: 3 is its smallest split")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--no-smollm2", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from batchinfer.engine.model_files import load_hf_config, resolve_model_path
    from tests.fixtures.tiny_models import build_tiny_model

    models = [("tiny-llama", str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama")), args.tp)]
    if not args.no_smollm2:
        models.append(("smollm2-135m", "smollm2-135m-instruct", args.smollm2_tp))
    print(f"CPU gloo, {os.cpu_count()} cores, 1 thread per rank, {args.num_seqs} sequences decoding, "
          f"median of {args.steps - 3} decode steps (ms on rank 0)")
    header = (f"{'model':<14}{'tp':>3}{'step':>9}{'allreduce':>11}{'#AR':>5}{'gather':>8}{'bcast':>8}"
              f"{'comm':>8}{'comm/step':>10}{'pure AR':>9}{'vs tp1':>8}")
    print(header)
    for name, model, tp in models:
        hidden = load_hf_config(resolve_model_path(model)).hidden_size
        single = measure_engine(model, 1, args.num_seqs, args.steps)
        multi = measure_engine(model, tp, args.num_seqs, args.steps)
        comm = multi["all_reduce"] + multi["gather"] + multi["broadcast"]
        pure = pure_allreduce_ms(tp, (args.num_seqs, hidden), int(multi["calls"]))
        print(f"{name:<14}{1:>3}{single['step']:>9.2f}{'-':>11}{'-':>5}{'-':>8}{'-':>8}{'-':>8}{'-':>10}{'-':>9}"
              f"{'1.00x':>8}")
        print(f"{name:<14}{tp:>3}{multi['step']:>9.2f}{multi['all_reduce']:>11.2f}{int(multi['calls']):>5}"
              f"{multi['gather']:>8.2f}{multi['broadcast']:>8.3f}{comm:>8.2f}{comm / multi['step']:>10.0%}"
              f"{pure:>9.2f}{single['step'] / multi['step']:>7.2f}x")
    print("allreduce includes waiting for the other rank; 'pure AR' = the same all-reduces among idle "
          "processes (data movement + gloo latency only); 'vs tp1' = tp1 step time / tpN step time.")


if __name__ == "__main__":
    main()
