"""The panel GEMM against oneDNN's prepacked GEMM over a whole model's linears, weights streamed from memory.

A decode step multiplies a few rows (one per sequence) by every weight of the model once, so the weights
come from memory, not cache: this runs the 121 GEMMs of a SmolLM2-135M-shaped model (30 layers of qkv, o,
gate_up, down, then the LM head; random weights, fp32 or bf16) as one "step" at each row count, through
weight_packing.PanelLinear (csrc/panel_gemm.cpp) and OneDnnLinear, alternating, and prints the median
step time, GFLOP/s and weight GB/s of each and their ratio. The panel GEMM needs an AVX2 + FMA build. On a
CPU with AMX, float32 runs a third kernel: amx_linear.AmxLinear (csrc/amx_gemm.cpp, bf16x3: what
float32_matmul_precision "high" runs), and each kernel's largest relative error against float64 is printed.
--huge-pages adds the panels again on transparent huge pages (engine/worker/huge_pages.py, as a CPU runner
places them) and prints their speed against the same panels on ordinary pages.

    .venv/bin/python bench/panel_gemm.py --rows 1 8 32 96 --dtype float32
    .venv/bin/python bench/panel_gemm.py --rows 1 4 8 16 32 96 --huge-pages --repeats 7
"""

from __future__ import annotations

import os

from batchinfer.engine.native.threads import configure_openmp_env, usable_cores

os.environ.setdefault("OMP_NUM_THREADS", str(usable_cores()))
configure_openmp_env()  # before torch is imported (OpenMP reads its wait policy then)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import torch  # noqa: E402

from batchinfer.engine.layers import amx_linear, weight_packing  # noqa: E402
from batchinfer.engine.worker.huge_pages import place_packs  # noqa: E402

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30  # SmolLM2-135M


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """The [N, K] weights of one step's GEMMs: per layer qkv, o, gate_up, down; then the head."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    return [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for n, k in [*shapes, (VOCAB, HIDDEN)]]


def step_seconds(kernels: Sequence[Callable[[torch.Tensor], torch.Tensor]], inputs: dict[int, torch.Tensor],
                 widths: Sequence[int]) -> float:
    """Wall time of one pass over every GEMM (input width K per kernel)."""
    start = time.perf_counter()
    for kernel, width in zip(kernels, widths, strict=True):
        kernel(inputs[width])
    return time.perf_counter() - start


def main() -> None:
    """Print each row count's median step time through both GEMMs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64, 96])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--huge-pages", action="store_true", help="also the panels on transparent huge pages")
    args = parser.parse_args()
    extension = weight_packing.panel_extension()
    if extension is None:
        raise SystemExit("the panel GEMM is not built here (it needs AVX2 + FMA)")
    dtype = getattr(torch, args.dtype)
    weights = model_weights(dtype)
    widths = [int(w.shape[1]) for w in weights]
    panel = [weight_packing.PanelLinear(w, None, extension) for w in weights]
    onednn = [weight_packing.onednn_linear(w, None) for w in weights]
    if any(kernel is None for kernel in onednn):
        raise SystemExit(f"oneDNN does not run {args.dtype} GEMMs here")
    kernels: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "panel": list(panel), "onednn": [k for k in onednn if k is not None]}
    if args.huge_pages:
        placed = [weight_packing.PanelLinear(w, None, extension) for w in weights]
        if not place_packs(placed):  # as a CPU runner places its packs
            raise SystemExit("no huge pages here (/sys/kernel/mm/transparent_hugepage/enabled is never)")
        kernels["panel+huge"] = list(placed)
    amx_ext = amx_linear.amx_extension() if dtype == torch.float32 else None
    if amx_ext is not None:
        kernels["amx"] = [amx_linear.AmxLinear(w, None, amx_ext) for w in weights]
        print_errors(weights[:4], kernels)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    weight_bytes = sum(p.panels.numel() * p.panels.element_size() for p in panel)
    print(f"{torch.get_num_threads()} threads, {args.dtype}, {len(weights)} GEMMs, "
          f"{weight_bytes / 1e6:.0f} MB of panels per step")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).to(dtype) for k in set(widths)}
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.repeats):  # alternating, so a noisy moment hits each
            for name, step in kernels.items():
                times[name].append(step_seconds(step, inputs, widths))
        line = [f"rows {rows:4d}"]
        for name, seconds in times.items():
            t = statistics.median(seconds)
            line.append(f"{name} {t * 1e3:7.1f} ms ({flops_per_row * rows / t / 1e9:6.1f} GFLOP/s, "
                        f"{weight_bytes / t / 1e9:5.1f} GB/s)")
        onednn_s = statistics.median(times["onednn"])
        ratios = [f"{name} {onednn_s / statistics.median(seconds):.2f}x oneDNN"
                  for name, seconds in times.items() if name != "onednn"]
        if "panel+huge" in times:
            gain = statistics.median(times["panel"]) / statistics.median(times["panel+huge"])
            ratios.append(f"huge pages {gain:.2f}x")
        print("  ".join(line + ratios), flush=True)


def print_errors(weights: Sequence[torch.Tensor],
                 kernels: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]) -> None:
    """Each kernel's largest error over a layer's GEMMs at 64 rows, relative to the float64 output's max."""
    gen = torch.Generator().manual_seed(1)
    worst = dict.fromkeys(kernels, 0.0)
    for i, weight in enumerate(weights):
        x = torch.randn(64, weight.shape[1], generator=gen)
        exact = x.double() @ weight.double().T
        for name, step in kernels.items():
            error = (step[i](x).double() - exact).abs().max() / exact.abs().max()
            worst[name] = max(worst[name], float(error))
    print("largest relative error vs float64: " + ", ".join(f"{n} {e:.1e}" for n, e in worst.items()))


if __name__ == "__main__":
    main()
