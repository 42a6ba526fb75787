"""Batched per-request sampling: one pass over the [batch, vocab] logits for the whole step.

Order (vLLM V1): grammar bitmask on the constrained rows (structured output; so logprobs are those of
the allowed tokens) -> raw log-softmax for logprobs -> allowed_token_ids / bad_words / logit_bias
(logits_controls.py, only on the rows asking, at a cost independent of their lists) -> min_tokens
mask -> penalties -> greedy argmax for temperature-0 rows -> temperature -> min_p -> top_k / top_p ->
exponential race. Per-request values travel as [batch] tensors; Python only loops over rows to collect
parameters and, for seeded rows, to draw that row's noise from its own generator.

Seeded requests are batch-invariant: row i's noise is q_i ~ Exp(1)^vocab drawn from a torch.Generator
seeded with the request's seed and advanced once per sampled token, and argmax(p_i / q_i) is an exact
sample from p_i (the exponential race / Gumbel-max trick), so neighbours in the batch cannot change it.
Unseeded rows share one generator seeded from EngineConfig.seed.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchinfer.engine.core.sequence import Sequence
from batchinfer.engine.sampling.logits_controls import ControlsCache, apply_logits_controls
from batchinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchinfer.engine.sampling.sampled_row import SampledRow


@dataclass
class SampleLogprobs:
    """Logprob figures of one sampled token, from the raw (unprocessed) log-softmax."""

    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class GrammarMask:
    """The step's grammar bitmask (xgrammar's packed int32 rows, 1 bit = allowed) and the rows it covers.

    Row `rows[i]` of the bitmask belongs to row `rows[i]` of the logits; other rows are not read.
    """

    bitmask: torch.Tensor  # [>= batch, ceil(vocab / 32)] int32, on CPU
    rows: list[int]


@dataclass
class ProcessedLogits:
    """Sampler.process's result: the logits ready to draw from, and the per-row switches it found."""

    logits: torch.Tensor  # float32; the caller's tensor unless a control, ban or penalty applied
    raw_logprobs: torch.Tensor | None  # [len(want_logprobs), vocab] log-softmax of the raw logits
    want_logprobs: list[int]  # rows whose request asked for logprobs
    random_rows: list[int]  # rows with temperature > 0


@dataclass
class SamplerOutput:
    """Per row: the sampled token id, and its logprobs when the request asked for them."""

    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]


class Sampler:
    """Samples one token per row with each row's own SamplingParams."""

    def __init__(self, *, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.controls = ControlsCache()  # each request's logits controls, precomputed once

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        eos_token_ids: AbstractSet[int],
        grammar: GrammarMask | None = None,
    ) -> SamplerOutput:
        """Sample the next token of every sequence; row i of `logits` belongs to seqs[i].

        The caller's logits stay untouched, except that `grammar`'s rows are masked in place: the engine's
        logits are scratch, and copying [256, 49152] floats would cost more than the mask itself.
        """
        processed = self.process(logits, seqs, eos_token_ids, grammar)
        logits, random_rows, want_logprobs = processed.logits, processed.random_rows, processed.want_logprobs
        params = [seq.params for seq in seqs]
        device = logits.device
        if len(random_rows) < len(seqs):
            token_ids = argmax_rows(logits)
        else:  # no greedy row: every row is drawn below
            token_ids = torch.empty(len(seqs), dtype=torch.long, device=device)
        if random_rows:
            probs = self.random_probs(logits[random_rows], [params[i] for i in random_rows])
            noise = self._exponential_noise(probs, [seqs[i] for i in random_rows])
            token_ids[random_rows] = argmax_rows(probs.div_(noise)).to(device)

        sampled = token_ids.tolist()
        logprobs: list[SampleLogprobs | None] = [None] * len(seqs)
        if processed.raw_logprobs is not None:
            for row, figures in zip(
                want_logprobs,
                gather_logprobs(
                    processed.raw_logprobs, token_ids[want_logprobs],
                    [params[i].logprobs for i in want_logprobs],
                ),
                strict=True,
            ):
                logprobs[row] = figures
        return SamplerOutput(token_ids=sampled, logprobs=logprobs)

    def process(
        self,
        logits: torch.Tensor,
        seqs: Sequence_[SampledRow],
        eos_token_ids: AbstractSet[int],
        grammar: GrammarMask | None = None,
    ) -> ProcessedLogits:
        """Everything before the draw: grammar mask, raw logprobs, logits controls, min_tokens, penalties.

        Speculative verification (spec_decode/verify.py) calls this on its per-position rows too.
        """
        params = [seq.params for seq in seqs]
        given = logits
        logits = logits.float()
        device = logits.device
        if grammar is not None and grammar.rows:
            apply_grammar_bitmask(logits, grammar.bitmask, grammar.rows)
        # One pass over the rows for the per-request switches (this runs for every sequence every step).
        want_logprobs: list[int] = []
        penalized: list[int] = []
        random_rows: list[int] = []
        controlled: list[int] = []
        for i, p in enumerate(params):
            if p.logprobs is not None:
                want_logprobs.append(i)
            if p.has_penalties:
                penalized.append(i)
            if not p.is_greedy:
                random_rows.append(i)
            if p.has_logits_controls:
                controlled.append(i)
        raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None

        banned_rows, banned_cols = _min_tokens_bans(seqs, eos_token_ids)
        if (banned_rows or penalized or controlled) and logits is given:
            logits = logits.clone()  # the caller's logits stay untouched
        if controlled:
            apply_logits_controls(logits, seqs, controlled, self.controls)
        if banned_rows:
            logits[banned_rows, banned_cols] = float("-inf")
        if penalized:
            logits[penalized] = apply_penalties(
                logits[penalized],
                [seqs[i].prompt_token_ids for i in penalized],
                [seqs[i].output_token_ids for i in penalized],
                presence=_tensor([params[i].presence_penalty for i in penalized], device),
                frequency=_tensor([params[i].frequency_penalty for i in penalized], device),
                repetition=_tensor([params[i].repetition_penalty for i in penalized], device),
            )
        return ProcessedLogits(logits, raw_logprobs, want_logprobs, random_rows)

    @staticmethod
    def random_probs(rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distributions of temperature > 0 rows: temperature, min_p, top_k / top_p, softmax."""
        device = rows.device
        rows = rows / _tensor([p.temperature for p in params], device).unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            rows = apply_min_p(rows, _tensor([p.min_p for p in params], device))
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            vocab = rows.shape[1]
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
            rows = apply_top_k_top_p(rows, top_k, _tensor([p.top_p for p in params], device))
        return torch.softmax(rows, dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Exp(1) noise per row: seeded rows from their own generator, the rest from the shared one."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, seq in enumerate(seqs) if seq.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_(
                generator=self.generator
            )
        for i, seq in enumerate(seqs):
            if seq.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=probs.device)
                    seq.generator.manual_seed(seq.seed)
                noise[i].exponential_(generator=seq.generator)
        return noise


def reads_only_argmax(row: SampledRow) -> bool:
    """True when this row's token is the argmax of its raw logits and nothing else of them is read.

    Greedy, with no logprobs, logits controls, penalties or grammar, and no min_tokens ban in force: the
    runner may then hand back the row screened (ModelRunnerProtocol.execute_model's argmax_only_rows).
    Anything new that reads or changes a greedy row's logits must make this False for it.
    """
    p = row.params
    return (p.is_greedy and p.logprobs is None and p.prompt_logprobs is None and not p.has_penalties
            and not p.has_logits_controls and p.structured_outputs is None
            and not (p.min_tokens and row.num_output_tokens < p.min_tokens))


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """values.argmax(dim=-1) (first maximum wins, NaN counts as the maximum), as int64.

    On CPU through numpy: torch's CPU argmax is not vectorised (~20 ms for 256 x 49152 on one thread),
    numpy's SIMD argmax does the same in ~2.5 ms. Same result, ties and NaN included.
    """
    if values.device.type == "cpu" and values.dtype == torch.float32 and values.dim() == 2:
        return torch.from_numpy(values.detach().numpy().argmax(axis=-1).astype("int64", copy=False))
    return values.argmax(dim=-1)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed tokens of `rows` to -inf, in place (xgrammar's kernel: CPU, or Triton on CUDA).

    The bitmask covers ceil(vocab / 32) * 32 ids; logits wider than that (a vocabulary padded past the
    mask) get their extra columns masked too, so a constrained row can never sample an id outside it.
    """
    from xgrammar import apply_token_bitmask_inplace

    bitmask = bitmask.to(logits.device, non_blocking=True)
    covered = bitmask.shape[1] * 32
    apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(covered, logits.shape[1]), indices=rows)
    if logits.shape[1] > covered:
        logits[rows, covered:] = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    *,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM penalties: repetition on prompt+output tokens; frequency/presence (OpenAI) on output tokens."""
    num_rows, vocab = logits.shape
    prompt_counts = _bin_counts(prompt_token_ids, vocab, logits.device)
    output_counts = _bin_counts(output_token_ids, vocab, logits.device)
    seen = (prompt_counts > 0) | (output_counts > 0)
    rep = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k logits (ties at the k-th kept), then its top_p nucleus (vLLM's algorithm)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    kth_value = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    outside_nucleus = cumulative <= (1 - top_p).unsqueeze(1)
    outside_nucleus[:, -1] = False  # the top token always stays
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _min_tokens_bans(seqs: Sequence_[SampledRow], eos: AbstractSet[int]) -> tuple[list[int], list[int]]:
    """(rows, token ids) to mask: EOS and stop token ids of sequences still short of min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        params = seq.params
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            banned = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos)
            rows.extend([i] * len(banned))
            cols.extend(banned)
    return rows, cols


def _bin_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] occurrence counts; rows are padded with the out-of-range id `vocab`."""
    width = max((len(ids) for ids in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, ids in enumerate(token_lists):
        padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    counts = torch.zeros((len(token_lists), vocab + 1), device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def gather_logprobs(
    raw: torch.Tensor, sampled: torch.Tensor, wanted: list[int | None]
) -> list[SampleLogprobs]:
    """Per row of the raw log-softmax: the chosen token's logprob and rank, and the row's top wanted[i]."""
    token_logprob = raw.gather(1, sampled.unsqueeze(1))
    ranks = ((raw > token_logprob).sum(dim=1) + 1).tolist()
    num_top = max(n or 0 for n in wanted)
    top_values, top_ids = raw.topk(num_top, dim=-1) if num_top else (raw[:, :0], raw[:, :0].long())
    top_value_lists, top_id_lists = top_values.tolist(), top_ids.tolist()
    return [
        SampleLogprobs(logprob=lp, rank=rank, top_token_ids=ids[: n or 0], top_logprobs=vals[: n or 0])
        for lp, rank, ids, vals, n in zip(
            token_logprob.squeeze(1).tolist(), ranks, top_id_lists, top_value_lists, wanted, strict=True
        )
    ]


def _tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
