"""Engine throughput on one GPU: batchinfer vs transformers' continuous batching, same model, same prompts.

The model has Llama-3.1-8B's shapes with random bf16 weights, built here from typed-in config values (no
hub access) and saved with save_pretrained (safetensors) plus a word-level tokenizer over its 128256 ids.
Workload as nano-vllm's bench.py: 256 prompts of random token ids, input and output lengths uniform in
100..1024, ignore_eos, temperature 0.6. Each side runs in its own process (clean GPU memory) and reports
output tokens per second; the parent prints both and the ratio.

Run: python bench/gpu_engine.py [--num-prompts 256] [--workdir DIR]   (writes $OUT/gpu_engine.json if OUT set)
     python bench/gpu_engine.py --smoke   (CPU, a 2-layer model of the same family: checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_31_8B = {  # config.json values of meta-llama/Llama-3.1-8B, typed in
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "attention_bias": False,
    "mlp_bias": False,
}
MAX_MODEL_LEN = 4096  # prompts and outputs stay under 2048 tokens
SMOKE = "--smoke" in sys.argv
if SMOKE:  # tiny model, short sequences, CPU float32: exercises every line but the GPU
    LLAMA_31_8B.update(vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=10001,
                       eos_token_id=10002)
DEVICE, DTYPE = ("cpu", "float32") if SMOKE else ("cuda", "bfloat16")
LENGTHS = (10, 40) if SMOKE else (100, 1024)


def workload(num_prompts: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, as nano-vllm's bench.py draws them."""
    rng = random.Random(seed)
    return [([rng.randint(0, 10000) for _ in range(rng.randint(*LENGTHS))], rng.randint(*LENGTHS))
            for _ in range(num_prompts)]


def build(model_dir: Path) -> None:
    """Random-weight Llama-3.1-8B-shaped model (initialized on the GPU) + tokenizer, saved to model_dir."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**LLAMA_31_8B, torch_dtype=DTYPE)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=DEVICE).to(getattr(torch, DTYPE))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(model_dir, safe_serialization=True)

    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    vocab["<|begin_of_text|>"] = vocab.pop(f"t{config.bos_token_id}")
    vocab["<|end_of_text|>"] = vocab.pop(f"t{config.eos_token_id}")
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>",
                            eos_token="<|end_of_text|>", unk_token="t0").save_pretrained(model_dir)


def run_ours(model_dir: Path, num_prompts: int) -> dict:
    """batchinfer's engine over the workload (all requests queued at once, as for the peer): tokens/s."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.llm_engine import Engine
    from batchinfer.engine.sampling_params import SamplingParams

    load_start = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model_dir), dtype=DTYPE, device=DEVICE,
                                 max_model_len=MAX_MODEL_LEN, max_num_seqs=256, max_num_batched_tokens=8192,
                                 attention_backend="torch" if SMOKE else "triton"))
    load_s = time.perf_counter() - load_start
    engine.add_request("warm-up", [1, 2, 3], SamplingParams(max_tokens=8))  # kernels compiled before timing
    while engine.has_unfinished():
        engine.step()
    prompts = workload(num_prompts)
    start = last_report = time.perf_counter()
    for i, (ids, n) in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    done = tokens = 0
    while engine.has_unfinished():
        for output in engine.step():
            done += 1
            tokens += len(output.outputs[0].token_ids)
        if time.perf_counter() - last_report > 10:
            last_report = time.perf_counter()
            print("PROGRESS " + json.dumps({"finished": done, "output_tokens": tokens,
                                            "seconds": round(last_report - start, 1)}), flush=True)
    elapsed = time.perf_counter() - start
    return {"output_tokens": tokens, "expected_tokens": sum(n for _, n in prompts), "seconds": elapsed,
            "tokens_per_s": tokens / elapsed, "load_seconds": load_s}


def run_hf(model_dir: Path, num_prompts: int) -> dict:
    """transformers' continuous batching over the same workload (per-request max_new_tokens, no EOS)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    load_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE), device_map=DEVICE,
                                                 attn_implementation="sdpa").eval()
    load_s = time.perf_counter() - load_start
    prompts = workload(num_prompts)
    # No eos in the config: the batching manager then disables EOS (-1), like ignore_eos.
    gen_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=1.0, top_k=0,
                                  max_new_tokens=max(n for _, n in prompts), pad_token_id=0)
    with torch.no_grad(), model.continuous_batching_context_manager(generation_config=gen_config, block=True,
                                                                    timeout=30) as manager:
        start = time.perf_counter()
        for i, (ids, n) in enumerate(prompts):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        done, tokens, last_report = 0, 0, start
        while done < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
            if time.perf_counter() - last_report > 10:  # lets the parent report a run it had to cut
                last_report = time.perf_counter()
                print("PROGRESS " + json.dumps({"finished": done, "output_tokens": tokens,
                                                "seconds": round(last_report - start, 1)}), flush=True)
            elif result is None and not manager.is_running():
                raise RuntimeError(f"transformers' batching loop stopped after {done} requests")
        elapsed = time.perf_counter() - start
    return {"output_tokens": tokens, "expected_tokens": sum(n for _, n in prompts), "seconds": elapsed,
            "tokens_per_s": tokens / elapsed, "load_seconds": load_s,
            "attn_implementation": model.config._attn_implementation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=int(os.environ.get("BENCH_NUM_PROMPTS", 256)))
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the model is saved (default: a temp dir)")
    parser.add_argument("--phase", choices=["build", "ours", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="CPU run of a tiny model (checks the script)")
    parser.add_argument("--deadline-s", type=float, default=float(os.environ.get("BENCH_DEADLINE_S", 1800)),
                        help="total seconds for build + both runs; a run cut short is reported as such")
    args = parser.parse_args()
    if not SMOKE and args.phase is None:
        import torch

        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="batchinfer-bench-"))
    model_dir = workdir / "llama-3.1-8b-random"

    if args.phase == "build":
        build(model_dir)
        return
    if args.phase in ("ours", "hf"):
        result = (run_ours if args.phase == "ours" else run_hf)(model_dir, args.num_prompts)
        print("RESULT " + json.dumps(result))
        return

    results: dict = {"num_prompts": args.num_prompts, "model": "Llama-3.1-8B shapes, random bf16 weights"}
    started = time.perf_counter()
    deadline = started + args.deadline_s
    smoke = ["--smoke"] if SMOKE else []
    if not (model_dir / "config.json").exists():
        print(f"building the random model in {model_dir} ...", flush=True)
        subprocess.run([sys.executable, __file__, "--phase", "build", "--workdir", str(workdir), *smoke],
                       check=True, timeout=max(1.0, deadline - time.perf_counter()))
        print(f"  built and saved in {time.perf_counter() - started:.0f} s", flush=True)
    for i, (phase, label) in enumerate((("ours", "batchinfer"), ("hf", "transformers continuous batching"))):
        # ours gets at most half of what is left, so the peer always has a turn
        limit = (deadline - time.perf_counter()) / (2 - i)
        print(f"running {label} on {args.num_prompts} prompts (limit {limit:.0f} s) ...", flush=True)
        cmd = [sys.executable, __file__, "--phase", phase, "--workdir", str(workdir),
               "--num-prompts", str(args.num_prompts), *smoke]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            progress = [json.loads(ln[len("PROGRESS "):]) for ln in out.splitlines()
                        if ln.startswith("PROGRESS ")]
            results[phase] = {"error": f"cut at the {limit:.0f} s limit", "progress": progress[-1:] or None}
            last = progress[-1] if progress else "none"
            print(f"  {label}: cut at the {limit:.0f} s limit; last progress: {last}")
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"  {label}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            results[phase] = {"error": proc.stderr[-3000:]}
            continue
        results[phase] = json.loads(lines[-1][len("RESULT "):])
        r = results[phase]
        print(f"  {label}: {r['output_tokens']} output tokens (of {r['expected_tokens']}) "
              f"in {r['seconds']:.1f} s = {r['tokens_per_s']:,.0f} tok/s "
              f"(model load {r['load_seconds']:.0f} s)", flush=True)
    if "tokens_per_s" in results.get("ours", {}) and "tokens_per_s" in results.get("hf", {}):
        ratio = results["ours"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        results["ratio_ours_over_hf"] = ratio
        print(f"throughput ratio batchinfer / transformers: {ratio:.2f}x")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_engine.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
