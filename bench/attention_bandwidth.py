"""Decode attention kernel bandwidth: KV bytes read per second, beside this machine's memory copy bandwidth.

Decode attention is memory-bound (each step reads every cached K/V row of every sequence once), so its
figure of merit is the effective bandwidth: the K/V bytes (and quantized params) it must read / its time.
The reference is a measured copy (y.copy_(x) of 256 MiB into touched memory: read + write bytes / time)
on the same threads. Runs csrc/paged_attention.cpp at each path this build has (cpu_attention.set_isa:
avx2, avx512, avx512_bf16; generic, the portable loops, on request) for fp32 / bf16 caches and int8 / u8
codes, SmolLM2-135M's attention shape (9 query heads over 3 kv heads of 64), batch x context
as given. With --skew the lengths fall linearly in batch order from the context to a twelfth of it, as in
a running batch in admission order (the oldest sequences first and longest): the threads' shares of the
reads are then unequal unless the kernel splits its work by cost.

    .venv/bin/python bench/attention_bandwidth.py --batch 32 96 --context 128 512 1024
    .venv/bin/python bench/attention_bandwidth.py --batch 96 --context 600 --dtypes fp32 bf16 --skew
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.kv_quant import FORMATS, quantize

BLOCK_SIZE = 16


def copy_gbps(mib: int = 256, repeats: int = 5) -> float:
    """Best-of GB/s of a copy (bytes read + written) between two touched `mib` MiB float32 tensors."""
    x = torch.ones(mib * 2**20 // 4)
    y = torch.zeros_like(x)  # touched first: the pages are mapped, so only the copy is timed
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - start)
    return 2 * x.numel() * 4 / best / 1e9


def cache(batch: int, context: int, kv_heads: int, head_dim: int, dtype: str, skew: bool = False):
    """(k, v, k_params, v_params, block_tables, seq_lens, bytes read) of a random paged cache."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    values = torch.randn(2, num_blocks * BLOCK_SIZE, kv_heads, head_dim)
    tables = torch.randperm(num_blocks).view(batch, blocks_per_seq).to(torch.int32)  # scattered blocks
    if skew:  # the oldest (first) sequences longest, down to a twelfth of the context
        lens = torch.linspace(context, max(1, context // 12), batch).round().to(torch.int32)
    else:
        lens = torch.full((batch,), context, dtype=torch.int32)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    rows = int(lens.sum()) * kv_heads * 2  # K and V rows read
    if dtype in ("int8", "u8"):
        fmt = FORMATS[dtype]
        (kc, kp), (vc, vp) = quantize(values[0], fmt), quantize(values[1], fmt)
        assert kp is not None and vp is not None
        params = (num_blocks, BLOCK_SIZE, kv_heads, fmt.num_params)
        return (kc.view(shape), vc.view(shape), kp.reshape(params).contiguous(),
                vp.reshape(params).contiguous(), tables, lens, rows * fmt.bytes_per_row(head_dim))
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    k, v = values[0].to(torch_dtype).view(shape), values[1].to(torch_dtype).view(shape)
    return k, v, None, None, tables, lens, rows * head_dim * torch_dtype.itemsize


def kernel_seconds(q, k, v, kp, vp, tables, lens, repeats: int) -> float:
    """Best-of seconds of one decode attention call."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        if kp is None:
            cpu_attention.paged_decode_attention(out, q, k, v, tables, lens, scale)
        else:
            cpu_attention.paged_decode_attention_quantized(out, q, k, v, kp, vp, tables, lens, scale)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Parse arguments, measure the copy bandwidth and each kernel path, print one table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 96])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "int8", "u8"])
    parser.add_argument("--paths", nargs="+", default=["avx2", "avx512", "avx512_bf16"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skew", action="store_true",
                        help="lengths falling in batch order from the context to a twelfth of it")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if cpu_attention.load() is None:
        raise SystemExit("the native CPU kernels are not available")
    copy = copy_gbps()
    print(f"{args.threads} threads, load {os.getloadavg()[0]:.2f}; copy (torch clone, read + write): "
          f"{copy:.1f} GB/s; best path built: {cpu_attention.set_isa('auto')}")
    print(f"| cache | batch | context{' (longest, lengths falling)' if args.skew else ''} | path | ms / call "
          "| KV GB/s | of copy |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for dtype in args.dtypes:
        for batch in args.batch:
            for context in args.context:
                k, v, kp, vp, tables, lens, nbytes = cache(batch, context, args.kv_heads, args.head_dim,
                                                           dtype, args.skew)
                q_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
                q = torch.randn(batch, args.heads, args.head_dim).to(q_dtype)
                for path in args.paths:
                    taken = cpu_attention.set_isa(path)
                    if taken != path:
                        continue  # not built here
                    seconds = kernel_seconds(q, k, v, kp, vp, tables, lens, args.repeats)
                    gbps = nbytes / seconds / 1e9
                    print(f"| {dtype} | {batch} | {context} | {path} | {seconds * 1e3:.3f} | {gbps:.1f} | "
                          f"{gbps / copy:.0%} |", flush=True)
    cpu_attention.set_isa("auto")
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
