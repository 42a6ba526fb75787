"""Engine bookkeeping per step: everything Engine.step does except the model forward.

The forward is stubbed IN THIS BENCHMARK ONLY: engine.model_runner.execute_model is replaced by a function
that returns precomputed float32 logits of the right shape ([scheduled, vocab]), so what is timed is the
scheduler, the block manager (allocation, prefix-cache hashing), the sampler's setup and its argmax, token
appends and stop checks, incremental detokenization, output assembly and the metrics update. The engine is
built on a tiny random Llama made with tests/fixtures/tiny_models.build_tiny_model (its BPE tokenizer is
what detokenizes); the stub's logits are --vocab wide (49152 = SmolLM2's vocabulary, so the sampler's
argmax costs what it would on SmolLM2; 0 = the tiny tokenizer's 512, leaving bookkeeping alone), each row
peaked on the next token of an English token stream (a different place in it per row), so every sequence
decodes ordinary, varied text. The stub's own time (moving the peaks) is measured and subtracted.

Steady-state decode: --num-seqs requests (default 256, distinct random prompts of --prompt-len tokens,
greedy, ignore_eos, max_tokens so none finishes) are all admitted and prefilled first; then --steps decode
steps are timed one by one, alternating metrics on (the engine as shipped) and metrics off
(Engine._record_step, which hands the step's latencies to MetricsRecorder.record_step in
batchinfer/engine/metrics.py, replaced by a no-op), so noise hits both alike. The metrics update is also
timed alone.
A per-component split (wrapped methods) and, with --profile, cProfile's top functions follow.

    .venv/bin/python bench/engine_overhead.py                      # 256 sequences, vocab 49152 and tiny
    .venv/bin/python bench/engine_overhead.py --steps 40 --profile  # quick, with a profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.fixtures

import torch  # noqa: E402

from batchinfer.engine.config import EngineConfig  # noqa: E402
from batchinfer.engine.llm_engine import Engine  # noqa: E402
from batchinfer.engine.sampling.sampler import argmax_rows  # noqa: E402
from batchinfer.engine.sampling_params import SamplingParams  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model, training_sentences  # noqa: E402

MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings


class StubForward:
    """Stands in for ModelRunner.execute_model: fixed random logits whose peak walks through real text.

    Row i's argmax at call c is token (offset_i + c) of an English token stream, so each sequence decodes
    ordinary text (the detokenizer's usual case) and tokens differ from row to row and step to step.
    Moving the peaks costs two small index writes per call; that time is measured (self.seconds) and
    taken out of the step times.
    """

    def __init__(self, num_rows: int, vocab: int, text_tokens: list[int]) -> None:
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.randn(num_rows, vocab, generator=generator).clamp_(-4.0, 4.0)
        self.stream = torch.tensor(text_tokens)
        self.offsets = torch.tensor([(i * 97) % len(text_tokens) for i in range(num_rows)])
        self.rows = torch.arange(num_rows)
        self.peaks = self.stream[self.offsets]
        self.logits[self.rows, self.peaks] = 100.0
        self.calls = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __call__(self, scheduled, logits_counts=None, *, argmax_only_rows=()) -> torch.Tensor:
        start, start_cpu = time.perf_counter(), time.thread_time()
        self.calls += 1
        self.logits[self.rows, self.peaks] = 0.0
        self.peaks = self.stream[(self.offsets + self.calls) % len(self.stream)]
        self.logits[self.rows, self.peaks] = 100.0
        out = self.logits[: len(scheduled)]
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - start_cpu
        return out


class Timers:
    """Wraps methods to sum their wall time per step (the wrapper adds ~0.2 us per call)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.enabled = False
        self._originals: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - start

        self._originals.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, timed)

    def unwrap(self) -> None:
        """Put back what was wrapped: the instance attribute, or the class's method."""
        for owner, name, original in reversed(self._originals):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()


def build_engine(model_dir: Path, args, vocab: int) -> tuple[Engine, StubForward]:
    """An engine on the tiny model with the forward stubbed, every sequence admitted and prefilled."""
    blocks_per_seq = -(-MAX_MODEL_LEN // 16)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=args.num_seqs,
                          max_model_len=MAX_MODEL_LEN, num_kv_blocks=args.num_seqs * blocks_per_seq + 16)
    engine = Engine(config)
    tokenizer_vocab = len(engine.tokenizer)
    special = set(engine.tokenizer.all_special_ids)
    ordinary = [i for i in range(tokenizer_vocab) if i not in special]
    text = " ".join(training_sentences(200, seed=3))
    text_tokens = engine.tokenizer.encode(text, add_special_tokens=False)
    stub = StubForward(args.num_seqs, max(vocab, tokenizer_vocab), text_tokens)
    engine.model_runner.execute_model = stub  # the benchmark's stub; the engine code is untouched
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_MODEL_LEN - args.prompt_len)
    for i in range(args.num_seqs):
        engine.add_request(f"r{i}", [rng.choice(ordinary) for _ in range(args.prompt_len)], params)
    while not all(seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_output_tokens > 0
                  for seq in engine.scheduler.running) or engine.scheduler.num_running < args.num_seqs:
        engine.step()
    for _ in range(5):  # warm-up decode steps
        engine.step()
    return engine, stub


def timed_steps(engine: Engine, stub: StubForward, num_steps: int, num_seqs: int) -> dict[str, list[float]]:
    """Per-step seconds (wall and this thread's CPU) with metrics on and off, alternating step by step."""
    shipped = engine._record_step

    def no_metrics() -> None:
        engine._ttfts, engine._itls = [], []

    samples: dict[str, list[float]] = defaultdict(list)
    for i in range(2 * num_steps):
        metrics = "on" if i % 2 == 0 else "off"
        engine._record_step = shipped if metrics == "on" else no_metrics
        stub_before, stub_cpu_before = stub.seconds, stub.cpu_seconds
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step()
        # The stub's own work is not the engine's.
        stub_cpu = stub.cpu_seconds - stub_cpu_before
        samples[f"cpu {metrics}"].append(time.thread_time() - start_cpu - stub_cpu)
        samples[metrics].append(time.perf_counter() - start - (stub.seconds - stub_before))
    engine._record_step = shipped
    if engine.scheduler.num_running != num_seqs:
        raise RuntimeError("sequences finished during the measurement; lower --steps")
    return samples


def record_step_alone(engine: Engine, num_seqs: int, repeats: int = 200) -> float:
    """Seconds per _record_step with a decode step's payload (num_seqs inter-token latencies)."""
    latencies = [0.02 + 0.0001 * i for i in range(num_seqs)]
    samples = []
    for _ in range(repeats):
        engine._itls = list(latencies)
        start = time.perf_counter()
        engine._record_step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def argmax_alone(stub: StubForward, repeats: int = 20) -> float:
    """Median seconds of the sampler's greedy argmax over the stub's [rows, vocab] logits (CPU time)."""
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        argmax_rows(stub.logits)
        samples.append(time.thread_time() - start)
    return statistics.median(samples)


def component_split(engine: Engine, stub: StubForward, num_steps: int) -> dict[str, float]:
    """Median-free split: summed seconds per component over num_steps steps, divided by num_steps."""
    timers = Timers()
    timers.wrap(engine.scheduler, "schedule", "scheduler.schedule (block allocation included)")
    timers.wrap(engine, "sampler", "sampler (setup + argmax over the vocab)")
    timers.wrap(engine, "_append_token", "append token + stop checks + detokenize")
    timers.wrap(engine.scheduler, "free_finished", "scheduler.free_finished")
    timers.wrap(engine, "_record_step", "metrics (_record_step)")
    original_update = type(engine.scheduler.running[0].detokenizer).update

    def detok_update(self, *args, **kwargs):
        if not timers.enabled:
            return original_update(self, *args, **kwargs)
        start = time.perf_counter()
        try:
            return original_update(self, *args, **kwargs)
        finally:
            timers.totals["  of which detokenizer.update"] += time.perf_counter() - start

    type(engine.scheduler.running[0].detokenizer).update = detok_update
    timers.enabled = True
    stub_before = stub.seconds
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    total = time.perf_counter() - start - (stub.seconds - stub_before)
    timers.enabled = False
    timers.unwrap()
    type(engine.scheduler.running[0].detokenizer).update = original_update
    order = ["scheduler.schedule (block allocation included)", "sampler (setup + argmax over the vocab)",
             "append token + stop checks + detokenize", "  of which detokenizer.update",
             "scheduler.free_finished", "metrics (_record_step)"]
    split = {label: timers.totals[label] / num_steps for label in order}
    accounted = sum(v for k, v in split.items() if not k.startswith("  "))
    split["rest of step() (loop, outputs, bookkeeping)"] = total / num_steps - accounted
    split["total (with wrappers)"] = total / num_steps
    return split


def profile_steps(engine: Engine, num_steps: int, top: int) -> None:
    """cProfile of num_steps steps, top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(num_steps):
        engine.step()
    profiler.disable()
    print(f"\ncProfile of {num_steps} steps, top {top} by own time (tottime is for all {num_steps} steps):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="timed steps each with metrics on and off")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 0],
                        help="logit widths to run (0 = the tiny tokenizer's own vocabulary)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    needed = 5 + 2 * args.steps + 20 + (20 if args.profile else 0)
    if args.prompt_len + needed >= MAX_MODEL_LEN:
        parser.error(f"--prompt-len + steps ({args.prompt_len} + {needed}) must stay under {MAX_MODEL_LEN}")
    torch.set_num_threads(1)

    print(f"machine: {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f} at start; model forward stubbed (precomputed logits)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("llama", Path(tmp) / "tiny-llama")
        for vocab in args.vocab:
            engine, stub = build_engine(model_dir, args, vocab)
            width = stub.logits.shape[1]
            samples = timed_steps(engine, stub, args.steps, args.num_seqs)
            alone = record_step_alone(engine, args.num_seqs)
            argmax_seconds = argmax_alone(stub)
            split = component_split(engine, stub, 20)
            rows.append((width, samples, alone, argmax_seconds))
            print(f"\nvocab {width}: {args.num_seqs} running sequences, "
                  f"{args.steps} + {args.steps} timed decode steps (metrics on/off alternating)")
            for name, values in samples.items():
                kind = "CPU time" if name.startswith("cpu") else "wall time"
                print(f"  step {kind}, metrics {name.split()[-1]:<3}: "
                      f"median {ms(statistics.median(values))} ms, "
                      f"mean {ms(statistics.mean(values))}, min {ms(min(values))}, "
                      f"p90 {ms(sorted(values)[int(0.9 * len(values))])}")
            print(f"  _record_step alone ({args.num_seqs} inter-token latencies): {ms(alone)} ms")
            print(f"  sampler's greedy argmax alone over [{args.num_seqs}, {width}] logits: "
                  f"{ms(argmax_seconds)} ms CPU")
            print("  split per step (ms, 20 steps, wrapped methods):")
            for label, seconds in split.items():
                print(f"    {label:<48} {ms(seconds)}")
            if args.profile:
                profile_steps(engine, 20, args.top)
            del engine, stub
    print(f"load average {os.getloadavg()[0]:.1f} at end")

    print()
    n = args.num_seqs
    print(f"| engine step, {n} running seqs, forward stubbed | wall ms / step (median) | "
          "CPU ms / step (median) | CPU ms without the vocab argmax | us / seq (CPU) | target < 1 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for width, samples, alone, argmax_seconds in rows:
        for metrics in ("on", "off"):
            wall, cpu = statistics.median(samples[metrics]), statistics.median(samples[f"cpu {metrics}"])
            bookkeeping = cpu - argmax_seconds
            verdict = "" if metrics == "off" else (
                f"{'met' if cpu < 1e-3 else f'{cpu / 1e-3:.1f}x over'} "
                f"({'met' if bookkeeping < 1e-3 else 'over'} without the argmax)")
            print(f"| vocab {width}, metrics {metrics} | {ms(wall)} | {ms(cpu)} | {ms(bookkeeping)} | "
                  f"{cpu / n * 1e6:.2f} | {verdict} |")
        print(f"| vocab {width}, metrics update alone (_record_step) | {ms(alone)} | | | "
              f"{alone / n * 1e6:.2f} | |")


if __name__ == "__main__":
    main()
