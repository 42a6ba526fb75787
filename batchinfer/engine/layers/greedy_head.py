"""Greedy rows of a float32 LM head: a bf16 GEMM screens the tokens that can be the argmax, float32 decides.

A greedy request reads one number of its [vocab] logits, the argmax. On a CPU with a native bf16 GEMM
(avx512_bf16, AMX) the head's bf16 product runs at twice the float32 rate or more, and its error has a bound
computable per token (csrc/greedy_head.cpp): every token whose window reaches the row's best lower bound is a
candidate and gets its float32 logit from a dot product; the others come back -inf, since they provably lose
to a candidate in float32. The argmax of such a row is the float32 argmax, so greedy outputs keep their
float32 promise (token-exact with transformers' float32 in bench/engine_throughput.py). It is the argmax of
these dot products' logits: a near-tie within float32 rounding may resolve otherwise than the head's GEMM.

ModelRunner.execute_model screens only the rows its caller names in `argmax_only_rows` (the engine's
plain greedy rows: sampler.reads_only_argmax); every other row gets its full float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.weight_packing import OneDnnLinear, onednn_supports
from batchinfer.engine.native.cpu_features import cpu_has_native_bf16

BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16: 8 significant bits, round to nearest
FP32_UNIT_ROUNDOFF = 2.0**-24
SAFETY = 2.0  # both bounds doubled: the bound's own float32 arithmetic, a GEMM that rounds its sums less well
# Per product term: bf16 dot-product hardware (avx512_bf16, AMX) reads denormal inputs as zero and flushes
# denormal results whatever MXCSR says, an absolute error no relative bound covers.
DENORMAL_FLOOR = 2.0**-126


def screen_slack(hidden_size: int) -> tuple[float, float, float]:
    """(relative to |x| |w_v|, relative to |approx_v|, flushed denormals' unit): the bf16 head's error bound.

    greedy_head.cpp adds the flushed denormals as unit * (sqrt(K) (|x| + |w_v|) + 2 K + 2): inputs read as
    zero lose under 2^-126 |w_vk| (or |x_k|) per term, flushed products and partial sums 2^-126 each.
    """
    u = BF16_UNIT_ROUNDOFF
    gamma = hidden_size * FP32_UNIT_ROUNDOFF / (1 - hidden_size * FP32_UNIT_ROUNDOFF)
    return SAFETY * (2 * u + u * u + 2 * gamma), SAFETY * u / (1 - u), SAFETY * DENORMAL_FLOOR


def screen_extension() -> Any:
    """The native extension when it has the screening kernel, else None."""
    ext = cpu_attention.load()
    return ext if ext is not None and hasattr(ext, "screen_argmax_logits") else None


class GreedyHead:
    """A float32 LM head's greedy rows: a bf16 screen of its [vocab, hidden] weight, candidates in float32."""

    def __init__(self, weight: torch.Tensor, ext: Any) -> None:
        self.weight = weight.detach().contiguous()  # the float32 output matrix (the tied embedding: a view)
        self.norms = self.weight.double().norm(dim=1).float()  # |w_v|, rounded: within SAFETY's margin
        self.approx = OneDnnLinear(self.weight, None, torch.bfloat16)  # half the float32 head's bytes
        self.rel_slack, self.out_slack, self.abs_slack = screen_slack(self.weight.shape[1])
        self._ext = ext
        self.candidates = 0  # tokens recomputed in float32 so far (bench/step_profile.py reports it)
        self.screened_rows = 0

    @classmethod
    def build(cls, head: torch.nn.Module | None, *, dtype: torch.dtype, device: torch.device,
              quantization: str | None, tensor_parallel_size: int) -> GreedyHead | None:
        """The screen for this model's head, or None where it does not pay or cannot run.

        Runs for a float32 head (not quantized: an int8 engine's float32 weight is only the tied
        embedding; not bf16x3) on one CPU rank that computes bf16 dot products natively (avx512_bf16,
        AMX): where oneDNN emulates bf16 (AVX-512 without avx512_bf16) or has none (AVX2) the screen's
        GEMM runs no faster than the float32 head.
        """
        weight = getattr(head, "weight", None)
        if (dtype != torch.float32 or device.type != "cpu" or quantization is not None
                or tensor_parallel_size != 1 or not isinstance(weight, torch.Tensor)
                or weight.dtype != torch.float32 or weight.dim() != 2 or weight.numel() == 0
                or not cpu_has_native_bf16() or not onednn_supports(torch.bfloat16)):
            return None
        ext = screen_extension()
        if ext is None or not bool(torch.isfinite(weight).all()):
            return None  # a non-finite weight has no bound
        return cls(weight, ext)

    def logits(self, hidden: torch.Tensor, argmax_only_rows: Sequence[int],
               full: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """float32 [rows, vocab]: argmax_only_rows screened (-inf but candidates), the others full(hidden)."""
        num_rows, vocab = hidden.shape[0], self.weight.shape[0]
        chosen = set(argmax_only_rows)
        if not chosen:
            return full(hidden).float()
        screened = sorted(chosen)
        if not 0 <= screened[0] <= screened[-1] < num_rows:
            raise ValueError(f"argmax_only_rows: rows {screened[0]}..{screened[-1]} of a step of {num_rows} "
                             "rows")
        out = torch.empty(num_rows, vocab, dtype=torch.float32)
        others = [row for row in range(num_rows) if row not in chosen]
        if others:
            out[others] = full(hidden[others]).float()
        x = (hidden[screened] if others else hidden).float().contiguous()
        approx = self.approx(x.to(torch.bfloat16))
        rows = torch.tensor(screened, dtype=torch.int64)
        self.candidates += int(self._ext.screen_argmax_logits(out, approx, x, self.weight, self.norms, rows,
                                                              self.rel_slack, self.out_slack, self.abs_slack))
        self.screened_rows += len(screened)
        return out

