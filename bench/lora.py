"""Multi-LoRA throughput: one workload on the base model alone, then spread over 1, 4 and 16 adapters.

Workload: --num-requests completion requests (default 128) on SmolLM2-135M-Instruct (the
`smollm2-135m-instruct` alias): distinct ~--prompt-tokens (default 64) token prompts, greedy, --max-tokens
new tokens each (default 32, ignore_eos), --dtype (default float32) on CPU. Request i runs under adapter
i % k (k = 1, 4, 16; random PEFT adapters, rank --rank on all seven projections, made once with peft under
--adapter-dir) with max_loras = max_cpu_loras = k, so every step carries every adapter it needs. The
script prints, for the base and each k: wall time, generated tokens/s, the ratio to the base (the issue's
target: >= 0.7x at 4 adapters on CPU), and the memory one loaded adapter takes (LoRAAdapter.num_bytes),
then a markdown table.

    .venv/bin/python bench/lora.py                          # base + 1/4/16 adapters, ~10 min on 4 threads
    .venv/bin/python bench/lora.py --num-requests 32 --max-tokens 16   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SENTENCE = ("the queue answers every request with care while workers sort blocks of memory before noon "
            "and the model computes many tokens in batches again")


def make_adapters(model_path: str, directory: Path, count: int, rank: int) -> list[Path]:
    """`count` random PEFT adapters of the model (made once; reused when the directory holds them)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [directory / f"adapter-{i:02d}" for i in range(count)]
    missing = [p for p in paths if not (p / "adapter_model.safetensors").is_file()]
    if missing:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, lora_dropout=0.0,
                            init_lora_weights=False, task_type="CAUSAL_LM")
        for path in missing:
            torch.manual_seed(int(path.name.rsplit("-", 1)[1]))
            model = get_peft_model(base, config)
            with torch.no_grad():  # a realistic delta: small next to the weights
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.mul_(0.05)
            model.save_pretrained(path, safe_serialization=True)
            base = model.unload()
    return paths


def prompts(count: int, tokens: int) -> list[str]:
    """Distinct prompts of about `tokens` tokens (no shared prefix: the prefix cache stays out of it)."""
    out = []
    for i in range(count):
        vocabulary = SENTENCE.split()
        words = [vocabulary[(i * 7 + j * 3) % len(vocabulary)] for j in range(tokens)]
        out.append(f"Request {i}: " + " ".join(words))
    return out


def run(model_path: str, texts: list[str], args: argparse.Namespace, adapters: list[Path]) -> dict:
    """Generate every prompt (under adapter i % k when adapters are given); timings and figures."""
    from batchinfer.engine import LLM, LoRARequest, SamplingParams

    k = len(adapters)
    options = {"enable_lora": True, "max_loras": k, "max_cpu_loras": k, "max_lora_rank": args.rank}
    options = options if k else {}
    llm = LLM(model_path, device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs, **options)
    requests = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    loras = [requests[i % k] for i in range(len(texts))] if k else None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(texts[:2], params, lora_request=loras[:2] if loras else None, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(texts, params, lora_request=loras, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    manager = getattr(llm.engine.model_runner, "lora_manager", None)
    adapter_bytes = next(iter(manager.loaded.values())).num_bytes if manager and manager.loaded else 0
    llm.close()
    del llm
    gc.collect()
    return {"adapters": k, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "adapter_bytes": adapter_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--adapter-counts", default="1,4,16")
    parser.add_argument("--adapter-dir", type=Path, default=Path("/tmp/batchinfer-bench-lora"))
    args = parser.parse_args()

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.models.resolved_model import resolve_model

    model_path = str(resolve_model(EngineConfig(model=args.model, device="cpu"), with_tokenizer=False).path)
    counts = [int(c) for c in args.adapter_counts.split(",")]
    paths = make_adapters(model_path, args.adapter_dir, max(counts), args.rank)
    texts = prompts(args.num_requests, args.prompt_tokens)
    print(f"{args.num_requests} requests x {args.max_tokens} tokens, {args.model}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, rank {args.rank} on all seven projections")
    results = [run(model_path, texts, args, [])]
    for count in counts:
        results.append(run(model_path, texts, args, paths[:count]))
    base = results[0]["tokens_per_s"]
    print("\n| adapters | time (s) | tokens/s | vs base | memory per adapter |")
    print("|---|---|---|---|---|")
    for r in results:
        memory = f"{r['adapter_bytes'] / 2**20:.2f} MiB" if r["adapters"] else "-"
        label = "base" if not r["adapters"] else str(r["adapters"])
        print(f"| {label} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{memory} |")


if __name__ == "__main__":
    main()
