"""A float32 head's greedy rows screened by its bf16 GEMM (layers/greedy_head.py, csrc/greedy_head.cpp): the
row's argmax is the float32 argmax, near ties and non-finite rows included; rows that read more than the
argmax get full logits; the engine's outputs are the unscreened engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine import SamplingParams
from batchinfer.engine.layers.greedy_head import GreedyHead, screen_extension, screen_slack
from batchinfer.engine.layers.weight_packing import onednn_supports
from batchinfer.engine.native.cpu_features import cpu_has_native_bf16
from batchinfer.engine.sampling.sampler import reads_only_argmax

ext = screen_extension()
needs_kernel = pytest.mark.skipif(ext is None, reason="the native CPU kernels are not built here")
native_bf16 = cpu_has_native_bf16() and onednn_supports(torch.bfloat16)
needs_bf16_gemm = pytest.mark.skipif(ext is None or not native_bf16, reason="no native bf16 GEMM here")


def _bf16_approx(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the head's bf16 GEMM returns: bf16 operands, float32 sums, bf16 output."""
    return (x.bfloat16().float() @ weight.bfloat16().float().T).bfloat16()


def _screen(x: torch.Tensor, weight: torch.Tensor,
            approx: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    out = torch.full((x.shape[0], weight.shape[0]), 7.0)
    rel, out_rel, denormal = screen_slack(weight.shape[1])
    approx = _bf16_approx(x, weight) if approx is None else approx
    found = ext.screen_argmax_logits(out, approx, x.contiguous(), weight.contiguous(),
                                     weight.double().norm(dim=1).float(), torch.arange(x.shape[0]), rel,
                                     out_rel, denormal)
    return out, found


def _near_tie_case(seed: int, rows: int = 64, vocab: int = 1000,
                   hidden: int = 576) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose top two tokens differ by 1-2e-3: below bf16's resolution of logits ~20, above float32's."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    x = torch.randn(rows, hidden, generator=gen) * 2
    for r in range(rows):  # token 2r + 1 = token 2r nudged along x[r]: their logits differ by ~1e-3
        gap = (1 + torch.rand((), generator=gen)) * 1e-3 * (1 if torch.rand((), generator=gen) < 0.5 else -1)
        w = weight[(2 * r) % vocab] + x[r] * (gap / x[r].norm() ** 2)
        weight[(2 * r + 1) % vocab] = w
        weight[(2 * r) % vocab] += x[r] * (20.0 / x[r].norm() ** 2)  # and both well above the rest (std ~2.4)
        weight[(2 * r + 1) % vocab] += x[r] * (20.0 / x[r].norm() ** 2)
    return x, weight


@needs_kernel
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_screened_argmax_is_the_float32_argmax_on_near_ties(seed: int) -> None:
    x, weight = _near_tie_case(seed)
    out, found = _screen(x, weight)
    exact = x.double() @ weight.double().T
    assert torch.equal(out.argmax(dim=1), exact.argmax(dim=1))
    assert not torch.equal(_bf16_approx(x, weight).argmax(dim=1), exact.argmax(dim=1))  # bf16 alone errs here
    # no token outside the candidates could have won: each loses to the best candidate in exact arithmetic
    candidates = torch.isfinite(out)
    assert int(candidates.sum()) == found and found >= 2 * x.shape[0]  # both tied tokens of every row
    best = exact.masked_fill(~candidates, float("-inf")).max(dim=1).values
    assert bool((exact.masked_fill(candidates, float("-inf")).max(dim=1).values < best).all())
    # the candidates hold their float32 logits
    torch.testing.assert_close(out[candidates], (x @ weight.T)[candidates], rtol=1e-5, atol=1e-5)
    assert bool((out[~candidates] == float("-inf")).all())


@needs_kernel
def test_a_wrong_approximation_outside_the_bound_is_what_the_bound_guards() -> None:
    """The screen trusts only its bound: an approximation moved by more than it names another winner."""
    x, weight = _near_tie_case(3, rows=4)
    approx = _bf16_approx(x, weight).float()
    exact = x @ weight.T
    winner = exact.argmax(dim=1)
    approx[torch.arange(4), winner] -= 100.0  # far outside any bf16 error: the true winner is screened out
    out, _ = _screen(x, weight, approx.bfloat16())
    assert not bool((out.argmax(dim=1) == winner).any())


@needs_kernel
def test_non_finite_rows_get_every_logit() -> None:
    x, weight = _near_tie_case(4, rows=3)
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    out, found = _screen(x, weight)
    assert found == 2 * weight.shape[0] + int(torch.isfinite(out[0]).sum())
    assert torch.isnan(out[2]).all()
    assert not torch.isfinite(out[1]).any()


@needs_kernel
def test_odd_sizes_and_float32_approximations() -> None:
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(37, 23, generator=gen), torch.randn(5, 23, generator=gen)
    out, _ = _screen(x, weight, (x @ weight.T))
    assert torch.equal(out.argmax(dim=1), (x.double() @ weight.double().T).argmax(dim=1))


@needs_bf16_gemm
@pytest.mark.parametrize("seed", [7, 8])
def test_the_onednn_approximation_stays_within_half_the_bound(seed: int) -> None:
    """The bound assumes float32 sums in oneDNN's bf16 GEMM: its real output, not a torch stand-in."""
    x, weight = _near_tie_case(seed)
    x[0] = 0.0
    x[1, ::2] = 1e-39  # denormal inputs
    x[2] *= 1e4
    head = GreedyHead(weight, ext)
    approx = head.approx(x.bfloat16()).float()
    exact = x.double() @ weight.double().T
    rel, out_rel, denormal = screen_slack(weight.shape[1])
    norm_x, norm_w, k = x.double().norm(dim=1, keepdim=True), head.norms.double(), weight.shape[1]
    bound = (rel * norm_x * norm_w + out_rel * approx.double().abs()
             + denormal * (k**0.5 * (norm_x + norm_w) + 2 * k + 2))
    assert bool(((approx.double() - exact).abs() <= bound / 2).all())


@needs_bf16_gemm
def test_mixed_steps_screen_only_the_named_rows() -> None:
    x, weight = _near_tie_case(6, rows=6)
    head = GreedyHead(weight, ext)
    full = lambda h: h @ weight.T  # noqa: E731
    out = head.logits(x, [4, 1, 4], full)
    others = [0, 2, 3, 5]
    assert torch.equal(out[others], x[others] @ weight.T)  # the full GEMM's rows, untouched
    for row in (1, 4):
        assert bool((out[row] == float("-inf")).any())
        assert int(out[row].argmax()) == int((x[row].double() @ weight.double().T).argmax())
    assert head.screened_rows == 2
    with pytest.raises(ValueError, match="argmax_only_rows"):
        head.logits(x, [6], full)
    assert torch.equal(head.logits(x, [], full), x @ weight.T)


def test_the_screen_is_built_for_float32_heads_only() -> None:
    weight = torch.randn(50, 16)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    lm_head.weight.data = weight
    cpu = torch.device("cpu")
    plain = {"device": cpu, "quantization": None, "tensor_parallel_size": 1}
    assert GreedyHead.build(lm_head, **{**plain, "dtype": torch.bfloat16}) is None
    assert GreedyHead.build(lm_head, dtype=torch.float32, **{**plain, "tensor_parallel_size": 2}) is None
    assert GreedyHead.build(lm_head, dtype=torch.float32, **{**plain, "quantization": "int8"}) is None
    assert GreedyHead.build(None, dtype=torch.float32, **plain) is None
    built = GreedyHead.build(lm_head, dtype=torch.float32, **plain)
    assert (built is not None) == (ext is not None and native_bf16)
    lm_head.weight.data[3, 2] = float("inf")
    assert GreedyHead.build(lm_head, dtype=torch.float32, **plain) is None


class _Row:
    def __init__(self, num_output_tokens: int = 0, **params: object) -> None:
        self.params = SamplingParams(**params)  # type: ignore[arg-type]
        self.num_output_tokens = num_output_tokens


@pytest.mark.parametrize(("params", "plain"), [
    ({"temperature": 0.0}, True),
    ({"temperature": 0.0, "ignore_eos": True, "stop": ["x"]}, True),
    ({"temperature": 0.7}, False),
    ({"temperature": 0.0, "logprobs": 2}, False),
    ({"temperature": 0.0, "prompt_logprobs": 1}, False),
    ({"temperature": 0.0, "repetition_penalty": 1.1}, False),
    ({"temperature": 0.0, "presence_penalty": 0.5}, False),
    ({"temperature": 0.0, "logit_bias": {3: 5.0}}, False),
    ({"temperature": 0.0, "allowed_token_ids": [1, 2]}, False),
    ({"temperature": 0.0, "bad_words": ["no"]}, False),
    ({"temperature": 0.0, "structured_outputs": {"choice": ["a", "b"]}}, False),
    ({"temperature": 0.0, "min_tokens": 3}, False),
])
def test_only_plain_greedy_rows_read_just_the_argmax(params: dict, plain: bool) -> None:
    assert reads_only_argmax(_Row(**params)) is plain


def test_min_tokens_rows_are_plain_once_the_ban_is_over() -> None:
    assert reads_only_argmax(_Row(num_output_tokens=3, temperature=0.0, min_tokens=3))


@needs_bf16_gemm
def test_engine_outputs_equal_the_unscreened_engine(tiny_llama: Path, make_llm) -> None:
    screened, full = make_llm(tiny_llama), make_llm(tiny_llama)
    assert screened.engine.model_runner.greedy_head is not None
    full.engine.model_runner.greedy_head = None
    prompts = ["the cat", "a dog reads", "one two three four", "the bird sat on"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=7)]
    got = screened.generate(prompts, params, use_tqdm=False)
    expected = full.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    # the logprobs row read full logits: its figures are the unscreened engine's
    got_lp, expected_lp = got[1].outputs[0].logprobs, expected[1].outputs[0].logprobs
    assert got_lp is not None and expected_lp is not None
    for step, ref in zip(got_lp, expected_lp, strict=True):
        assert step.keys() == ref.keys()
        for token_id, figure in step.items():
            assert figure.logprob == pytest.approx(ref[token_id].logprob, abs=1e-5)
    assert screened.engine.model_runner.greedy_head.screened_rows > 0


@needs_bf16_gemm
def test_int8_engines_keep_their_int8_head(tiny_llama: Path, make_llm) -> None:
    """An int8 engine's float32 head weight is only its tied table: its greedy rows run its int8 head."""
    assert make_llm(tiny_llama, quantization="int8").engine.model_runner.greedy_head is None
