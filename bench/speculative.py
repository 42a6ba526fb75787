"""Speculative decoding on a copy-heavy workload: SmolLM2-135M-Instruct with and without speculation.

Workload: chat requests that each give a short customer record (a passage of ~120 tokens) and ask the
model to quote two of its sentences exactly and then list its fields as `field: value` lines, so most
of the answer is copied from the prompt (what extraction, quoting and form filling look like). Greedy,
--max-tokens new tokens each, fp32 on CPU, one torch thread by default.

For each batch size B (--batch-sizes, default 1 4 64) the same B x --rounds requests run with
max_num_seqs = B (so B sequences decode together), once per configuration:

  off        no speculation (the baseline)
  ngram      prompt lookup, k = --k (6), prompt_lookup_min/max 2/5, the default policy (speculation off
             while more than disable_by_batch_size = 8 sequences run)
  ngram-on   the same with the policy off (disable_by_batch_size 1024): what speculation costs at B
  draft      (--draft-layers N) a draft made of SmolLM2's first N layers (spec_decode.truncated_draft),
             k = --draft-k; an experiment: there is no smaller SmolLM2 to use as a draft

Printed per run: acceptance rate (accepted / proposed tokens), mean accepted length (tokens emitted per
verification, 1 + accepted / verifications), tok/s (generated tokens / wall time of the whole run,
prefill included), per-token latency (per request: (finish - first token) / (tokens - 1), averaged),
and the ratios against `off` at the same B; outputs are checked identical to `off` (greedy is exact).

    .venv/bin/python bench/speculative.py
    .venv/bin/python bench/speculative.py --batch-sizes 1 4 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from batchinfer.engine import LLM, SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
FIRST = ["Maria", "John", "Aiko", "Pedro", "Fatima", "Olga", "Kwame", "Lena", "Ravi", "Chloe"]
LAST = ["Lopez", "Smith", "Tanaka", "Silva", "Khan", "Petrova", "Mensah", "Berg", "Patel", "Martin"]
CITIES = ["Lisbon", "Denver", "Osaka", "Nairobi", "Toronto", "Leeds", "Porto", "Austin", "Lyon", "Pune"]
ITEMS = ["a blue kettle", "two garden chairs", "a desk lamp", "a set of knives", "a rain jacket",
         "a coffee grinder", "three notebooks", "a yoga mat", "a bike helmet", "a wool blanket"]
ISSUES = ["arrived with a cracked lid", "was delivered to the wrong door", "came two weeks late",
          "was missing its manual", "did not match the photo", "was charged twice"]


def record_prompt(rng: random.Random) -> str:
    """One copy-heavy request: a customer record, then 'quote these sentences, list these fields'."""
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    city, item, issue = rng.choice(CITIES), rng.choice(ITEMS), rng.choice(ISSUES)
    order = rng.randint(100000, 999999)
    amount = f"{rng.randint(5, 400)}.{rng.randint(0, 99):02d}"
    email = name.lower().replace(" ", ".") + "@example.com"
    passage = (
        f"Customer {name} lives in {city} and can be reached at {email}. "
        f"On order number {order} they bought {item} for {amount} dollars. "
        f"The customer says the order {issue}. "
        f"They would like a refund of {amount} dollars to the original card. "
        f"The ticket was opened by the support desk in {city} on a Monday morning."
    )
    return (
        f"Here is a support ticket:\n\n{passage}\n\n"
        "First quote, word for word, the sentence that says what the customer bought and the sentence "
        "with the complaint. Then list these fields, one per line as `field: value`: name, city, email, "
        "order number, item, amount."
    )


@dataclass
class Run:
    label: str
    batch: int
    seconds: float
    tokens: int
    latency_s: float  # mean per-token decode latency
    drafts: int
    draft_tokens: int
    accepted: int
    outputs: list[list[int]]

    @property
    def acceptance(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


def run(label: str, spec: dict | None, batch: int, conversations: list, args) -> Run:
    """One configuration at one batch size (a fresh engine; the model load is outside the clock)."""
    llm = LLM(MODEL, device="cpu", dtype="float32", max_num_seqs=batch, max_model_len=1024,
              num_kv_blocks=max(256, batch * 24), speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.chat(conversations[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    before = llm.engine.get_stats()
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    seconds = time.perf_counter() - start
    stats = llm.engine.get_stats()
    latencies = []
    for out in outputs:
        n = len(out.outputs[0].token_ids)
        if n > 1:
            latencies.append((out.metrics.finished_time - out.metrics.first_token_time) / (n - 1))
    llm.close()
    return Run(label, batch, seconds, sum(len(o.outputs[0].token_ids) for o in outputs),
               statistics.mean(latencies), stats.spec_num_drafts - before.spec_num_drafts,
               stats.spec_num_draft_tokens - before.spec_num_draft_tokens,
               stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
               [o.outputs[0].token_ids for o in outputs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 64])
    parser.add_argument("--rounds", type=int, default=2, help="requests per batch size = B x rounds")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=6, help="n-gram proposal length")
    parser.add_argument("--draft-layers", type=int, default=0, help="also run a truncated-SmolLM2 draft")
    parser.add_argument("--draft-k", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared, busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    configs: list[tuple[str, dict | None]] = [
        ("off", None),
        ("ngram", {"method": "ngram", "num_speculative_tokens": args.k}),
        ("ngram-on", {"method": "ngram", "num_speculative_tokens": args.k, "disable_by_batch_size": 1024}),
    ]
    if args.draft_layers:
        from batchinfer.engine.model_files import resolve_model_path
        from batchinfer.engine.spec_decode.truncated_draft import write_truncated_draft

        draft_dir = Path(tempfile.mkdtemp(prefix="smollm2-draft-"))
        write_truncated_draft(resolve_model_path(MODEL), draft_dir, args.draft_layers)
        configs.append((f"draft{args.draft_layers}L", {"method": "draft_model", "model": str(draft_dir),
                                                        "num_speculative_tokens": args.draft_k,
                                                        "disable_by_batch_size": 1024}))
    print(f"load before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    rows = []
    for batch in args.batch_sizes:
        conversations = [[{"role": "user", "content": record_prompt(rng)}]
                         for _ in range(batch * args.rounds)]
        base = None
        for label, spec in configs:
            if label.startswith("draft") and batch > 4:
                continue  # the draft experiment: small batches only
            result = run(label, spec, batch, conversations, args)
            base = result if label == "off" else base
            assert base is not None
            same = sum(a == b for a, b in zip(result.outputs, base.outputs, strict=True))
            rows.append((result, base, same))
            print(f"B={batch:<3} {label:<10} {result.tokens / result.seconds:7.1f} tok/s  "
                  f"{1000 * result.latency_s:7.1f} ms/token  accept {100 * result.acceptance:5.1f}%  "
                  f"mean accepted length {result.mean_accepted_length:4.2f}  "
                  f"latency x{base.latency_s / result.latency_s:4.2f} lower  "
                  f"tok/s x{(result.tokens / result.seconds) / (base.tokens / base.seconds):4.2f}  "
                  f"identical {same}/{len(result.outputs)}", flush=True)
    print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("\n| B | config | tok/s | ms/token | acceptance | mean accepted length | latency ratio "
          "| tok/s ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for result, base, _ in rows:
        print(f"| {result.batch} | {result.label} | {result.tokens / result.seconds:.1f} | "
              f"{1000 * result.latency_s:.1f} | {100 * result.acceptance:.1f}% | "
              f"{result.mean_accepted_length:.2f} | "
              f"{base.latency_s / result.latency_s:.2f}x | "
              f"{(result.tokens / result.seconds) / (base.tokens / base.seconds):.2f}x |")


if __name__ == "__main__":
    main()
