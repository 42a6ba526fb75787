"""The exact block GEMM (float32 over 4-bit blocks on AMX) against the panel GEMM over a model's linears.

A SmolLM2-135M-shaped step's 120 layer GEMMs (30 layers of qkv, o, gate_up, down; the LM head keeps its
own kernel) with random Q4_1-like blocks (codes 0..15, fp16 d and m per 32 inputs): the panel GEMM runs
their float32 de-quantization (what a float32 GGUF model runs without exact blocks), the block kernel
(engine/layers/exact_blocks.py, csrc/amx_block_gemm.cpp) the blocks, alternating step by step; prints the
median step time of each and their ratio at each row count, and each kernel's largest error against
float64 on one layer's shapes. Needs a CPU with AMX bf16 tiles.

    .venv/bin/python bench/exact_blocks.py --rows 1 8 16 32 64 96
"""

from __future__ import annotations

import os

from batchinfer.engine.native.threads import configure_openmp_env, usable_cores

os.environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))
configure_openmp_env()  # before torch is imported (OpenMP reads its wait policy then)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from batchinfer.engine.layers import amx_linear, weight_packing  # noqa: E402
from batchinfer.engine.layers.exact_blocks import ExactBlockLinear  # noqa: E402
from batchinfer.engine.layers.gguf_weights import BlockWeight  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, LAYERS = 576, 1536, 960, 30  # SmolLM2-135M
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def random_blocks(rows: int, columns: int, gen: torch.Generator) -> BlockWeight:
    """Q4_1-like blocks as a GGUF file holds them."""
    groups = columns // 32
    d = (torch.rand(rows, groups, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-8 * d * (1 + 0.2 * torch.randn(rows, groups, generator=gen))).half().float()
    codes = torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8, generator=gen)
    return BlockWeight("q4", codes, d, m)


def main() -> None:
    """Build the step's kernels both ways, print the errors, then the alternating step times."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 96])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    amx, panels = amx_linear.amx_extension(), weight_packing.panel_extension()
    if amx is None or panels is None:
        raise SystemExit("needs the native kernels with AMX bf16 tiles and the panel GEMM")
    gen = torch.Generator().manual_seed(0)
    kernels = []  # (K, panel kernel, block kernel) per GEMM
    for _ in range(LAYERS):
        for n, k in SHAPES:
            blocks = random_blocks(n, k, gen)
            panel = weight_packing.PanelLinear(blocks.dequantize(), None, panels)
            kernels.append((k, panel, ExactBlockLinear(blocks, None, amx)))
    for (k, panel, block), (n, _) in zip(kernels[:4], SHAPES, strict=True):
        x = torch.randn(96, k, generator=gen)
        weight = panel.weight().double()
        exact = x.double() @ weight.T
        scale = exact.abs().max()
        errors = [float((f(x).double() - exact).abs().max() / scale) for f in (panel, block)]
        print(f"{n} x {k}, 96 rows: largest error vs float64 panel {errors[0]:.1e}, blocks {errors[1]:.1e}")
    parameters = sum(n * k for n, k in SHAPES) * LAYERS
    print(f"{torch.get_num_threads()} threads, {len(kernels)} GEMMs, {parameters / 1e6:.1f} M parameters: "
          f"panels {4 * parameters / 1e6:.0f} MB, blocks {0.75 * parameters / 1e6:.0f} MB per step")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {"panel": [], "blocks": []}
        for _ in range(args.repeats):
            for name, index in (("panel", 1), ("blocks", 2)):
                start = time.perf_counter()
                for kernel in kernels:
                    kernel[index](inputs[kernel[0]])
                times[name].append(time.perf_counter() - start)
        panel_ms, block_ms = (1e3 * statistics.median(times[n]) for n in ("panel", "blocks"))
        gflops = 2 * rows * parameters / 1e9
        print(f"rows {rows:4d}  panel {panel_ms:6.1f} ms ({gflops / panel_ms * 1e3:6.1f} GFLOP/s)  "
              f"blocks {block_ms:6.1f} ms ({gflops / block_ms * 1e3:6.1f} GFLOP/s)  "
              f"blocks {panel_ms / block_ms:.2f}x the panel GEMM")


if __name__ == "__main__":
    main()
