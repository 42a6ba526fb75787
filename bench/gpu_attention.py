"""Attention microbenchmarks on one GPU: our paged Triton kernel against torch SDPA on the same data.

Decode: batch 64, context 2048, Llama-3-8B heads (32 q, 8 kv, dim 128), bf16, block size 16. SDPA gets the
same K/V dense and contiguous (the best case for it); our kernel reads them through shuffled block tables.
Reported: time per call, achieved K/V bandwidth (bytes of K and V read / time) and its share of the measured
device copy bandwidth; a sweep of launch configs; a long-context small-batch case (split-KV on/off); and
a prefill case (4 x 1024 new tokens, causal) in TFLOP/s. Prints figures only; asserts nothing but sanity.

Run: python bench/gpu_attention.py   (writes $OUT/gpu_attention.json when OUT is set)
     python bench/gpu_attention.py --smoke   (CPU, Triton interpreter, tiny shapes: checks the script runs)
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from triton.testing import do_bench  # noqa: E402

# The module itself: the name kernels.paged_attention is the function.
pa = importlib.import_module("batchinfer.kernels.paged_attention")

HQ, HKV, D, BLOCK = 32, 8, 128, 16
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16
# (batch, context) of the decode case, the long-context case; (sequences, new tokens) of the prefill case
SIZES = {"decode": (4, 64), "long": (1, 1024), "prefill": (1, 64)} if SMOKE else {
    "decode": (64, 2048), "long": (4, 16384), "prefill": (4, 1024)}


def paged_copy(dense: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """dense [B, Hkv, L, D] -> cache [num_blocks, BLOCK, Hkv, D] laid out through block_tables."""
    b, hkv, length, d = dense.shape
    cache = torch.empty(num_blocks, BLOCK, hkv, d, dtype=dense.dtype, device=dense.device)
    per_block = dense.permute(0, 2, 1, 3).reshape(b, length // BLOCK, BLOCK, hkv, d)
    cache[block_tables.long()] = per_block
    return cache


def make_case(batch: int, context: int, q_len: int, seed: int = 0) -> dict:
    """Every sequence holds `context` keys, the last q_len of them new this step."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=DEVICE, generator=g).view(batch, blocks_per_seq).int()
    k = torch.randn(batch, HKV, context, D, device=DEVICE, dtype=DTYPE, generator=g)
    v = torch.randn(batch, HKV, context, D, device=DEVICE, dtype=DTYPE, generator=g)
    q = torch.randn(batch * q_len, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
    return {
        "q": q, "k": k, "v": v,
        "k_cache": paged_copy(k, block_tables, num_blocks),
        "v_cache": paged_copy(v, block_tables, num_blocks),
        "cu_seqlens_q": torch.arange(0, batch * q_len + 1, q_len, device=DEVICE, dtype=torch.int32),
        "seq_lens": torch.full((batch,), context, device=DEVICE, dtype=torch.int32),
        "block_tables": block_tables, "batch": batch, "context": context, "q_len": q_len,
    }


def ours(case: dict, cfg: pa.LaunchConfig | None = None):
    """A callable running our kernel on the case (the heuristic's config unless cfg is given)."""
    args = (case["q"], case["k_cache"], case["v_cache"])
    meta = {"cu_seqlens_q": case["cu_seqlens_q"], "seq_lens": case["seq_lens"],
            "block_tables": case["block_tables"]}
    out = torch.empty_like(case["q"])
    scale = D**-0.5
    if cfg is None:
        return lambda: pa.paged_attention(*args, **meta, scale=scale, out=out, max_seqlen_q=case["q_len"],
                                          max_seqlen_k=case["context"])
    return lambda: pa.launch(*args, meta["cu_seqlens_q"], meta["seq_lens"], meta["block_tables"], scale, out,
                             cfg)


def sdpa(case: dict, backend=None):
    """A callable running torch SDPA on the dense K/V of the case ([B, H, L, D], GQA, causal if prefill)."""
    b, q_len = case["batch"], case["q_len"]
    q = case["q"].view(b, q_len, HQ, D).transpose(1, 2)
    causal = q_len > 1

    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q, case["k"], case["v"], is_causal=causal, enable_gqa=True)
        with torch.nn.attention.sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, case["k"], case["v"], is_causal=causal, enable_gqa=True)

    return run


def ms(fn) -> float:
    """Median milliseconds per call."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    fn()  # compile outside the timing: do_bench sizes its loop from a first call
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth_gbs() -> float:
    """Device memory bandwidth as a 2 GiB tensor copy achieves it (bytes read + bytes written)."""
    src = torch.empty(1 << (20 if SMOKE else 31), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def check(case: dict) -> float:
    """Max |ours - SDPA| (sanity: both must compute the same attention)."""
    got = pa.paged_attention(case["q"], case["k_cache"], case["v_cache"], cu_seqlens_q=case["cu_seqlens_q"],
                             seq_lens=case["seq_lens"], block_tables=case["block_tables"], scale=D**-0.5)
    want = sdpa(case)().transpose(1, 2).reshape(got.shape)
    return (got.float() - want.float()).abs().max().item()


def main() -> None:
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke)")
    name, sms = ("cpu (interpreter smoke run)", 4) if SMOKE else (
        torch.cuda.get_device_properties(0).name, torch.cuda.get_device_properties(0).multi_processor_count)
    report: dict = {"device": name, "sms": sms}
    print(f"device: {name}, {sms} SMs, torch {torch.__version__}")
    copy_gbs = copy_bandwidth_gbs()
    report["copy_GBps"] = copy_gbs
    print(f"device copy bandwidth (read+write): {copy_gbs:,.0f} GB/s")

    # -- decode: batch 64, context 2k --------------------------------------------------------------------
    batch, context = SIZES["decode"]
    case = make_case(batch, context, 1)
    kv_bytes = 2 * case["batch"] * case["context"] * HKV * D * case["k"].element_size()
    run = ours(case)
    err = check(case)
    rows = []
    for name, fn in [("ours (heuristic config)", run), ("torch SDPA (default)", sdpa(case))]:
        rows.append((name, ms(fn)))
    for backend_name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(torch.nn.attention.SDPBackend, backend_name)
        try:
            fn = sdpa(case, backend)
            fn()
            rows.append((f"torch SDPA ({backend_name.lower()})", ms(fn)))
        except RuntimeError as exc:
            print(f"  SDPA {backend_name}: unavailable ({str(exc).splitlines()[0][:80]})")
    default_cfg = pa.choose_config(num_tokens=batch, num_seqs=batch, num_kv_heads=HKV, group=HQ // HKV,
                                   head_dim=D, elem_bytes=2, max_seqlen_q=1, max_seqlen_k=context,
                                   num_sms=sms)
    print(f"\ndecode: batch {batch}, context {context}, {HQ}q/{HKV}kv heads, dim {D}, {DTYPE}, "
          f"block {BLOCK}; K/V bytes read per call {kv_bytes / 1e6:.0f} MB; max|ours - SDPA| = {err:.3g}")
    print(f"heuristic config: {default_cfg}")
    print(f"{'':34s} {'us':>9s} {'K/V GB/s':>10s} {'% of copy bw':>13s}")
    best_sdpa = min(t for name, t in rows if name.startswith("torch"))
    for name, t in rows:
        gbs = kv_bytes / (t * 1e-3) / 1e9
        print(f"{name:34s} {t * 1e3:9.1f} {gbs:10,.0f} {100 * gbs / copy_gbs:12.1f}%")
    report["decode"] = {name: {"us": t * 1e3, "GBps": kv_bytes / (t * 1e-3) / 1e9} for name, t in rows}
    print(f"ours / best SDPA time ratio: {rows[0][1] / best_sdpa:.2f} (< 1: ours faster)")

    print("\nsweep (block_n, num_splits, num_warps, num_stages) for the same decode step:")
    sweep = []
    sweep_end = time.perf_counter() + 45  # each config compiles first; stay inside the step's time limit
    for block_n in (16, 32, 64)[: 1 if SMOKE else 3]:
        for splits in (1, 2, 4)[: 2 if SMOKE else 3]:
            for warps, stages in ((4, 3), (4, 2))[: 1 if SMOKE else 2]:
                if time.perf_counter() > sweep_end:
                    break
                cfg = pa.LaunchConfig(16, block_n, splits, warps, stages)
                try:
                    t = ms(ours(case, cfg))
                except Exception as exc:  # a config the GPU rejects (resources): report and go on
                    print(f"  {cfg}: failed ({type(exc).__name__})")
                    continue
                sweep.append((t, cfg))
    sweep.sort(key=lambda x: x[0])
    for t, cfg in sweep[:8]:
        gbs = kv_bytes / (t * 1e-3) / 1e9
        print(f"  bn={cfg.block_n:3d} splits={cfg.num_splits} warps={cfg.num_warps} stages={cfg.num_stages}: "
              f"{t * 1e3:7.1f} us  {gbs:8,.0f} GB/s ({100 * gbs / copy_gbs:.0f}% of copy)")
    report["decode_sweep_best"] = [{"us": t * 1e3, **cfg.__dict__} for t, cfg in sweep[:8]]

    # -- long context, small batch: what split-KV is for ------------------------------------------------
    batch, context = SIZES["long"]
    case = make_case(batch, context, 1, seed=1)
    kv_bytes = 2 * batch * context * HKV * D * case["k"].element_size()
    t_auto = ms(ours(case))
    auto_cfg = pa.choose_config(num_tokens=batch, num_seqs=batch, num_kv_heads=HKV, group=HQ // HKV,
                                head_dim=D, elem_bytes=2, max_seqlen_q=1, max_seqlen_k=context, num_sms=sms)
    t_one = ms(ours(case, pa.LaunchConfig(auto_cfg.block_m, auto_cfg.block_n, 1, auto_cfg.num_warps,
                                          auto_cfg.num_stages)))
    t_sdpa = ms(sdpa(case))
    print(f"\ndecode: batch {batch}, context {context}: "
          f"ours split-KV ({auto_cfg.num_splits} splits) {t_auto * 1e3:.1f} us "
          f"({kv_bytes / (t_auto * 1e-3) / 1e9:,.0f} GB/s), no split {t_one * 1e3:.1f} us, "
          f"SDPA {t_sdpa * 1e3:.1f} us")
    report["long_context"] = {"split_us": t_auto * 1e3, "nosplit_us": t_one * 1e3, "sdpa_us": t_sdpa * 1e3}

    # -- prefill: 4 sequences x 1024 new tokens, causal --------------------------------------------------
    seqs, new = SIZES["prefill"]
    case = make_case(seqs, new, new, seed=2)
    flops = 4 * seqs * HQ * D * (new * (new + 1) / 2)  # QK^T and PV over the causal half
    err = check(case)
    rows = [("ours (heuristic config)", ms(ours(case))), ("torch SDPA (default, causal)", ms(sdpa(case)))]
    for cfg in (pa.LaunchConfig(128, 64, 1, 8, 3), pa.LaunchConfig(128, 32, 1, 8, 2),
                pa.LaunchConfig(64, 32, 1, 4, 3), pa.LaunchConfig(64, 64, 1, 4, 3))[: 1 if SMOKE else 4]:
        try:
            rows.append((f"ours bm={cfg.block_m} bn={cfg.block_n} w={cfg.num_warps} s={cfg.num_stages}",
                         ms(ours(case, cfg))))
        except Exception as exc:
            print(f"  {cfg}: failed ({type(exc).__name__})")
    print(f"\nprefill: {seqs} x {new} new tokens, causal; max|ours - SDPA| = {err:.3g}")
    for name, t in rows:
        print(f"{name:40s} {t * 1e3:9.1f} us {flops / (t * 1e-3) / 1e12:7.1f} TFLOP/s")
    report["prefill"] = {name: t * 1e3 for name, t in rows}

    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_attention.json").write_text(json.dumps(report, indent=2, default=str))
    assert math.isfinite(err)


if __name__ == "__main__":
    main()
