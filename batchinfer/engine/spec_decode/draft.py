"""Draft-model proposer: a second, smaller model that shares the target's tokenizer guesses k tokens.

The draft is a ModelRunner of its own with its own KV cache tensors, as many blocks as the target's, and
it mirrors the target's block tables: the draft's K/V of position p of a sequence sit in the same block
id and offset as the target's, so no second block manager is needed and every block the scheduler gives
a sequence (including the k lookahead slots of a speculative step) is the draft's too.

Per sequence the proposer remembers how far the draft's cache is valid: the positions it computed from real
tokens, plus the draft tokens it ran past them, which stay valid as far as the target accepted them. Each
proposal first catches up (the prompt on the first call, then the tokens accepted since), chunked to
max_num_batched_tokens (fewer on a CPU: worker/step_budget.py), then runs k - 1 one-token steps for the whole
batch (the k-th draft is never run through the draft). A preempted sequence lost its blocks, so the engine
calls forget() for it.

Greedy and seeded target rows take the draft's argmax (their verification does not read q); unseeded
rows sample from the draft's q (temperature, top_k, top_p, min_p of the request) with the proposer's own
generator, and q goes to the rejection sampler.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers.quantization import quantization_format
from batchinfer.engine.models.resolved_model import resolve_model
from batchinfer.engine.sampling.sampler import Sampler, argmax_rows
from batchinfer.engine.spec_decode.rejection import sample_exponential_race
from batchinfer.engine.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from batchinfer.engine.core.sequence import Sequence as EngineSequence
    from batchinfer.engine.lora.request import LoRARequest


@dataclasses.dataclass
class _DraftSeq:
    """What the draft's ModelRunner reads of a sequence (ARCHITECTURE.md, contract 2)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    lora_request: LoRARequest | None = None  # the draft proposes from its base model (no adapters)


class DraftModelProposer:
    """Runs the draft model k times per step for the speculating sequences (see module docstring)."""

    def __init__(self, spec: SpeculativeConfig, target_config: EngineConfig, *, num_kv_blocks: int,
                 vocab_size: int, max_model_len: int) -> None:
        from batchinfer.engine.worker.model_runner import ModelRunner

        assert spec.model is not None
        # A GGUF target's block format applies to a GGUF draft only; another draft runs in the target's dtype.
        quantization = quantization_format(target_config.quantization).draft_quantization(spec.model)
        config = dataclasses.replace(
            target_config, model=spec.model, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
            tensor_parallel_size=1, speculative_config=None, quantization=quantization,
            enable_lora=False,  # the target's adapters do not fit the draft: it proposes from its base
        )
        try:
            model = resolve_model(config, with_tokenizer=False)
        except (ValueError, FileNotFoundError, OSError) as exc:
            raise ValueError(f"speculative_config.model: {spec.model!r}: {exc}") from exc
        if model.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({model.vocab_size} ids) differs from the "
                f"target's ({vocab_size}); a draft must share the target's tokenizer"
            )
        self.k = spec.num_speculative_tokens
        self.runner = ModelRunner(config, model, screen_greedy_rows=False)  # its logits are sampled whole
        self.max_num_batched_tokens = self.runner.step_tokens  # on a CPU the draft MLP's cut (step_budget.py)
        self.generator = torch.Generator(device=self.runner.device)
        self.generator.manual_seed(target_config.seed + 1)
        # seq -> (positions computed from real tokens, draft tokens the draft ran right after them)
        self._state: weakref.WeakKeyDictionary[EngineSequence, tuple[int, list[int]]] = \
            weakref.WeakKeyDictionary()

    def forget(self, seqs: Sequence[EngineSequence]) -> None:
        """Drop what the draft's cache held for `seqs` (preempted: their blocks went to others)."""
        for seq in seqs:
            self._state.pop(seq, None)

    def close(self) -> None:
        """Release the draft runner."""
        self.runner.close()

    def _valid_prefix(self, seq: EngineSequence) -> int:
        """Positions of `seq` whose draft K/V is computed from its actual tokens."""
        state = self._state.get(seq)
        if state is None:
            return 0
        computed, ran = state
        tokens = seq.token_ids
        for token in ran:
            if computed >= len(tokens) or tokens[computed] != token:
                break
            computed += 1
        return min(computed, len(tokens) - 1)  # the last token is always run: its logits propose d_1

    def _run_to_end(self, views: list[_DraftSeq]) -> list[torch.Tensor]:
        """Run every view's uncomputed tokens (chunked to the token budget); each one's last logits."""
        out: list[torch.Tensor | None] = [None] * len(views)
        pending = list(range(len(views)))
        while pending:
            batch: list[tuple[int, int]] = []
            budget = self.max_num_batched_tokens
            for index in pending:
                view = views[index]
                num_new = min(len(view.token_ids) - view.num_computed_tokens, budget)
                if num_new < 1:
                    break
                batch.append((index, num_new))
                budget -= num_new
            logits = self.runner.execute_model([(views[i], n) for i, n in batch])
            unfinished = []
            for row, (index, num_new) in enumerate(batch):
                view = views[index]
                view.num_computed_tokens += num_new
                if view.num_computed_tokens == len(view.token_ids):
                    out[index] = logits[row]
                else:
                    unfinished.append(index)
            pending = unfinished + pending[len(batch):]
        # every view ran to its end above: no None is left in out
        return out  # type: ignore[return-value]

    def propose(self, seqs: Sequence[EngineSequence],
                max_tokens: Sequence[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Per sequence: (up to max_tokens[i] draft tokens, q [len, vocab] or None for greedy/seeded rows)."""
        views = [_DraftSeq(list(seq.token_ids), self._valid_prefix(seq), seq.block_table) for seq in seqs]
        sampled_rows = [not seq.params.is_greedy and seq.seed is None for seq in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        logits = self._run_to_end(views)
        for j in range(max(max_tokens, default=0)):
            rows = torch.stack([logits[i] for i in active])
            tokens, probs = self._choose([seqs[i] for i in active], rows, [sampled_rows[i] for i in active])
            next_active = []
            for row, index in enumerate(active):
                drafts[index].append(tokens[row])
                if probs is not None and sampled_rows[index]:
                    draft_probs[index].append(probs[row])
                if j + 1 < max_tokens[index]:
                    views[index].token_ids.append(tokens[row])
                    next_active.append(index)
            active = next_active
            if not active:
                break
            step = self.runner.execute_model([(views[i], 1) for i in active])
            # filled below for the rows still active; only those are read next round
            logits = [None] * len(seqs)  # type: ignore[list-item]
            for row, index in enumerate(active):
                views[index].num_computed_tokens += 1
                logits[index] = step[row]
        for seq, view in zip(seqs, views, strict=True):
            num_real = len(seq.token_ids)
            self._state[seq] = (num_real, view.token_ids[num_real : view.num_computed_tokens])
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, draft_probs, strict=True)]

    def _choose(self, seqs: list[EngineSequence], logits: torch.Tensor,
                sampled: list[bool]) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft token: argmax, or a sample of q for unseeded temperature > 0 rows (and q)."""
        tokens = argmax_rows(logits).tolist()
        rows = [i for i, flag in enumerate(sampled) if flag]
        if not rows:
            return tokens, None
        probs = Sampler.random_probs(logits[rows].float(), [seqs[i].params for i in rows])
        full = torch.zeros_like(logits, dtype=probs.dtype)
        for row, index in enumerate(rows):
            tokens[index] = sample_exponential_race(probs[row], self.generator)
            full[index] = probs[row]
        return tokens, full
