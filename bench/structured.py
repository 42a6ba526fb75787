"""Structured output cost: a job with half its rows constrained vs the same job unconstrained, same lengths.

Workload: --rows chat prompts on SmolLM2-135M-Instruct (fp32 on CPU, bf16 on CUDA). Runs, on one engine:
  1. the constrained job: every other row carries a JSON Schema (four schemas, seeded sampling, stops at
     the grammar's end or --max-tokens), the rest are free (greedy, ignore_eos, --max-tokens each);
  2. the same job unconstrained: the same sampling params without the constraint, with ignore_eos and a
     formerly constrained row's max_tokens set to the length its constrained output had, so both jobs
     generate exactly the same token counts (ignore_eos cannot apply to constrained rows: their grammar
     ends them).
Each job runs --repeats times, alternating, from a cold prefix cache; the best time of each is kept.
Both run after a warm-up job that also compiles the four grammars (their compile time, spent in the
background thread, is printed on its own: a job pays it once per distinct schema). Prints tok/s of both,
the slowdown, the in-engine bitmask fill per step, and the mask cost per step at 256 rows measured alone:
the batched bitmask fill of 256 mid-object matchers plus the sampler's masking of [256, vocab] logits.

    .venv/bin/python bench/structured.py                        # 256 rows, 64 tokens
    .venv/bin/python bench/structured.py --rows 64 --max-tokens 32 --threads 1   # small, shared machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time

import torch

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["label", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 4}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "address": {"type": "object", "properties": {
                                          "street": {"type": "string", "maxLength": 30},
                                          "number": {"type": "integer", "minimum": 1, "maximum": 9999}},
                                          "required": ["street", "number"], "additionalProperties": False}},
     "required": ["city", "address"], "additionalProperties": False},
]
TOPICS = ["a lazy cat", "the ocean", "a city library", "jazz", "honey bees", "chess", "trains", "bread"]


def prompts_for(tokenizer, rows: int) -> list[list[int]]:
    """Chat prompts as token ids: row i asks for JSON (schema i // 2 mod 4) or for prose."""
    out = []
    for i in range(rows):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2 == 0:
            ask = f"Reply with JSON matching {json.dumps(SCHEMAS[(i // 2) % len(SCHEMAS)])} about {topic}."
        else:
            ask = f"Write a few sentences about {topic} (request {i})."
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def constrained_params(rows: int, max_tokens: int, offset: int = 0) -> list:
    from batchinfer.engine import SamplingParams
    from batchinfer.engine.sampling_params import StructuredOutputsParams

    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    schemas = [StructuredOutputsParams(json=schema) for schema in SCHEMAS]
    return [free if i % 2 else SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens,
                                              structured_outputs=schemas[(i // 2 + offset) % len(SCHEMAS)])
            for i in range(rows)]


def timed_generate(llm, prompts, params) -> tuple[list, float]:
    """Generate from a cold prefix cache (else the second job would skip the prefill the first paid)."""
    assert llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return outputs, time.perf_counter() - start


def in_engine_mask_cost(llm, prompts, params) -> tuple[list, float, list[float]]:
    """Run the job with the engine's per-step mask fill and the sampler timed; returns per-step seconds."""
    structured = llm.engine.structured
    fill_seconds: list[float] = []
    fill = structured.mask

    def timed_fill(seqs):
        start = time.perf_counter()
        mask = fill(seqs)
        fill_seconds.append(time.perf_counter() - start)
        return mask

    structured.mask = timed_fill
    try:
        outputs, seconds = timed_generate(llm, prompts, params)
    finally:
        structured.mask = fill
    return outputs, seconds, fill_seconds


def mask_cost_at(llm, rows: int, repeats: int) -> dict[str, float]:
    """Seconds per step at `rows` constrained rows: the bitmask fill, and the sampler's masking."""
    from batchinfer.engine import SamplingParams
    from batchinfer.engine.core.sequence import Sequence
    from batchinfer.engine.sampling.sampler import apply_grammar_bitmask
    from batchinfer.engine.sampling.structured import GrammarBackend, GrammarState

    engine = llm.engine
    device = torch.device(engine.model_runner.device)
    backend = GrammarBackend(engine.tokenizer, vocab_size=engine.vocab_size,
                             eos_token_ids=engine.eos_token_ids, max_num_seqs=rows, device=device)
    prefixes = ['{"name": "Ad', '{"label": "pos', '{"tags": ["a", "', '{"city": "Rome", "address": {"st']
    seqs = []
    for i in range(rows):
        params = SamplingParams(temperature=0.7, seed=i, max_tokens=64, structured_outputs={
            "json": SCHEMAS[i % len(SCHEMAS)]})
        seq = Sequence(f"m{i}", [1, 2, 3], params, max_tokens=64)
        seq.grammar = GrammarState(backend.compile(params.structured_outputs))
        backend.start(seq.grammar)
        assert seq.grammar.matcher.accept_string(prefixes[i % len(prefixes)])  # mid-object, mid-string
        seqs.append(seq)
    every = list(range(rows))
    logits = torch.randn(rows, engine.vocab_size, device=device)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    fill = best(lambda: backend.fill_bitmask(seqs, every))
    apply = best(lambda: apply_grammar_bitmask(logits, backend.bitmask[:rows], every))
    backend.close()
    return {"fill": fill, "apply": apply}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mask-rows", type=int, default=256, help="rows of the isolated mask measurement")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each job, alternating; best kept")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from batchinfer.engine import LLM
    from batchinfer.engine.model_files import resolve_model_path
    from batchinfer.engine.models.loader import load_tokenizer

    prompts = prompts_for(load_tokenizer(resolve_model_path(args.model)), args.rows)
    block_size = 16
    blocks = sum(-(-(len(p) + args.max_tokens) // block_size) for p in prompts)  # every row at once
    llm = LLM(args.model, device=args.device, max_num_seqs=max(args.rows, args.mask_rows),
              max_model_len=args.max_model_len, block_size=block_size, num_kv_blocks=blocks + 8)
    warm = min(8, args.rows)
    llm.generate(prompts[:warm], constrained_params(warm, 8, offset=1))  # kernels, allocator, tokenizer info

    params = constrained_params(args.rows, args.max_tokens)
    outputs, constrained_s, fills = in_engine_mask_cost(llm, prompts, params)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    finished = sum(o.outputs[0].finish_reason == "stop" for o in outputs[::2])
    valid = 0
    for o in outputs[::2]:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    matched = [dataclasses.replace(p, structured_outputs=None, ignore_eos=True, max_tokens=length)
               for p, length in zip(params, lengths, strict=True)]
    free_outputs, free_s = timed_generate(llm, prompts, matched)
    assert [len(o.outputs[0].token_ids) for o in free_outputs] == lengths
    for _ in range(args.repeats - 1):  # alternate, keep the best of each: load drifts on a shared machine
        again, seconds, more_fills = in_engine_mask_cost(llm, prompts, params)
        assert [len(o.outputs[0].token_ids) for o in again] == lengths  # seeded: the same job again
        constrained_s, fills = min(constrained_s, seconds), fills + more_fills
        free_s = min(free_s, timed_generate(llm, prompts, matched)[1])
    tokens = sum(lengths)
    backend = llm.engine.grammar_backend
    alone = mask_cost_at(llm, args.mask_rows, repeats=10)

    device = torch.device(llm.engine.model_runner.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device {where}; torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}")
    print(f"rows {args.rows} (half constrained), max_tokens {args.max_tokens}, generated tokens {tokens}")
    print(f"constrained rows: {finished}/{len(outputs[::2])} ended at the grammar's end, "
          f"{valid} parse as JSON")
    print(f"grammars compiled {backend.num_compiled} in {backend.compile_seconds * 1e3:.1f} ms (background)")
    print(f"half constrained: {tokens / constrained_s:8.1f} tok/s ({constrained_s:.2f} s)")
    print(f"unconstrained:    {tokens / free_s:8.1f} tok/s ({free_s:.2f} s)")
    print(f"slowdown: {(constrained_s / free_s - 1) * 100:+.1f}%")
    print(f"in-engine bitmask fill: {statistics.mean(fills) * 1e3:.2f} ms/step mean over {len(fills)} steps "
          f"({args.rows // 2} constrained rows at most)")
    print(f"mask at {args.mask_rows} rows alone: fill {alone['fill'] * 1e3:.2f} ms + apply "
          f"{alone['apply'] * 1e3:.2f} ms = {(alone['fill'] + alone['apply']) * 1e3:.2f} ms/step")
    llm.close()


if __name__ == "__main__":
    main()
