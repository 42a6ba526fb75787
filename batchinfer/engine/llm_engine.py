"""The engine loop (Engine.add_request / step / abort) and the offline API (LLM.generate / LLM.chat).

step() = schedule -> model_runner.execute_model -> sample the sequences whose scheduled chunk reached
their last token -> append tokens, advance num_computed_tokens, detokenize, check stops -> free the
finished. Validation happens in add_request before any state changes, so a bad request raises a
ValueError naming the field and leaves the engine and every other request untouched.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchinfer.engine.block_manager import BlockManager, cdiv
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.detokenizer import IncrementalDetokenizer
from batchinfer.engine.sampler import SampleLogprobs, Sampler
from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.engine.scheduler import Scheduler
from batchinfer.engine.sequence import Sequence, SequenceStatus
from batchinfer.metrics import EngineMetrics, FinishedRequestStats, StatLogger, StepStats


@dataclass
class Logprob:
    """Log-probability of one token at one position (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's n completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: sampled + top-N
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions (final once `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt in tokens."""
        return len(self.prompt_token_ids)


@dataclass
class EngineStats:
    """Figures for metrics: queue sizes, KV usage, prefix cache and token counters (totals since start)."""

    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens (vLLM semantics)
    prefix_cache_hits: int  # tokens
    prefix_cache_block_queries: int
    prefix_cache_block_hits: int
    num_preemptions: int
    prompt_tokens: int  # prompt tokens computed (a preempted request's recompute counts again)
    generation_tokens: int  # tokens sampled
    step_prompt_tokens: int  # the same two figures for the last step only
    step_generation_tokens: int
    num_steps: int


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float


class Engine:
    """A continuously batching engine over one model: add requests, call step() until done."""

    def __init__(self, config: EngineConfig) -> None:
        from batchinfer.engine.loader import load_hf_config, load_tokenizer, resolve_model_path
        from batchinfer.engine.model_runner import ModelRunner

        self.config = config
        model_path = resolve_model_path(config.model)
        hf_config = load_hf_config(model_path)
        self.max_model_len = _resolve_max_model_len(config, hf_config)  # fail before loading weights
        if config.tensor_parallel_size > 1:
            from batchinfer.engine.tp_runner import TensorParallelRunner

            self.model_runner: Any = TensorParallelRunner(config)
        else:
            self.model_runner = ModelRunner(config)
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size: int = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(model_path, hf_config, self.tokenizer)
        self.block_manager = BlockManager(
            self.model_runner.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            namespace=config.model,
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler(seed=config.seed, device=self.model_runner.device)
        self._requests: dict[str, _Request] = {}
        # decode([token id]) per skip_special_tokens value, shared by every sequence's detokenizer
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}
        self._prompt_tokens = self._generation_tokens = self._num_steps = 0
        self._step_prompt_tokens = self._step_generation_tokens = 0
        self.metrics = EngineMetrics(config.model)
        self.stat_logger = StatLogger()
        self._reported = (0, 0, 0)  # prefix queries, hits, preemptions already folded into the metrics
        self._ttfts: list[float] = []
        self._itls: list[float] = []

    def close(self) -> None:
        """Release what outlives a step: tensor-parallel worker processes (a no-op for one rank)."""
        close = getattr(self.model_runner, "close", None)
        if close is not None:
            close()

    # --- requests ------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field (engine state unchanged)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string; got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be a SamplingParams; got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer; got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt: must be a string; got {cache_salt!r}")
        prompt_token_ids = self.tokenize(prompt, add_special_tokens=add_special_tokens)
        max_tokens = self._check_lengths(len(prompt_token_ids), params)
        bad_stop_ids = [i for i in params.stop_token_ids if i >= self.vocab_size]
        if bad_stop_ids:
            raise ValueError(
                f"stop_token_ids: {bad_stop_ids} outside the vocabulary (size {self.vocab_size})"
            )

        arrival = time.time() if arrival_time is None else arrival_time
        seqs = [
            Sequence(
                request_id,
                prompt_token_ids,
                params,
                max_tokens=max_tokens,
                index=i,
                arrival_time=arrival,
                priority=priority,
                cache_salt=cache_salt,
            )
            for i in range(params.n)
        ]
        for seq in seqs:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.num_prompt_tokens, params,
                token_texts=self._token_texts[params.skip_special_tokens],
            )
            self.scheduler.add(seq)  # siblings queue side by side, so they share the prompt's blocks
        text = prompt if isinstance(prompt, str) else None
        self._requests[request_id] = _Request(request_id, text, prompt_token_ids, seqs, arrival)

    def tokenize(self, prompt: str | list[int], *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt given as text or ids (ids are checked against the vocabulary)."""
        if isinstance(prompt, str):
            token_ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        elif isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt: token ids {bad[:5]} outside the vocabulary (size {self.vocab_size})"
                )
        else:
            raise ValueError(f"prompt: must be a string or a list of token ids; got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        return token_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its final output (None if unknown)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        now = time.time()
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq)
                seq.finished_time = now
        output = self._make_output(request)
        self._record_finished(output)
        return output

    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""
        return bool(self._requests)

    def get_num_unfinished(self) -> int:
        """Requests queued or running."""
        return len(self._requests)

    # --- the loop ------------------------------------------------------------------------------------

    def step(self, *, include_unfinished: bool = False) -> list[RequestOutput]:
        """Run one iteration; returns the requests that finished (and, if asked, those that progressed)."""
        self._step_prompt_tokens = self._step_generation_tokens = 0
        scheduled = self.scheduler.schedule().scheduled
        if not scheduled:
            return []  # everything runnable was preempted this step; it is readmitted on the next
        self._num_steps += 1
        scheduled_time = time.time()
        logits = self.model_runner.execute_model(scheduled)

        rows: list[int] = []
        prompt_tokens = 0
        for row, (seq, num_new) in enumerate(scheduled):  # per sequence per step: keep it lean
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = scheduled_time
            start = seq.num_computed_tokens
            end = start + num_new
            if start < seq.num_prompt_tokens:
                prompt_tokens += min(end, seq.num_prompt_tokens) - start
            seq.num_computed_tokens = end
            if end == len(seq.token_ids):  # the chunk reached the end: sample
                rows.append(row)
        self._step_prompt_tokens = prompt_tokens

        progressed: dict[str, _Request] = {}  # requests to report: those with a finished sequence, or all
        if rows:
            seqs = [scheduled[row][0] for row in rows]
            # A decode step samples every row: skip the [rows, vocab] gather copy (tens of MB at vocab 49k).
            sampled = self.sampler(logits if len(rows) == len(scheduled) else logits[rows], seqs,
                                   self.eos_token_ids)
            now = time.time()  # the tokens exist from here: first-token, inter-token and finish times
            for seq, token_id, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
                self._append_token(seq, token_id, logprobs, now)
                if include_unfinished or seq.is_finished:
                    progressed[seq.request_id] = self._requests[seq.request_id]
            self._step_generation_tokens = len(rows)
        self._prompt_tokens += self._step_prompt_tokens
        self._generation_tokens += self._step_generation_tokens
        self.scheduler.free_finished()

        outputs = []
        for request in progressed.values():
            finished = all(seq.is_finished for seq in request.seqs)
            if finished:
                del self._requests[request.request_id]
            if finished or include_unfinished:
                outputs.append(self._make_output(request))
            if finished:
                self._record_finished(outputs[-1])
        self._record_step()
        return outputs

    def _record_step(self) -> None:
        """Fold this step into the Prometheus metrics and the periodic log line (a few O(1) updates)."""
        cache = self.block_manager.stats
        queries, hits, preemptions = cache.queries, cache.hits, self.scheduler.num_preemptions
        seen_queries, seen_hits, seen_preemptions = self._reported
        self._reported = (queries, hits, preemptions)
        stats = StepStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.block_manager.usage,
            num_prompt_tokens=self._step_prompt_tokens,
            num_generation_tokens=self._step_generation_tokens,
            prefix_cache_queries=queries - seen_queries,
            prefix_cache_hits=hits - seen_hits,
            num_preemptions=preemptions - seen_preemptions,
            time_to_first_tokens=self._ttfts,
            inter_token_latencies=self._itls,
        )
        self.metrics.record_step(stats)
        self.stat_logger.record_step(stats)
        self._ttfts, self._itls = [], []

    def _record_finished(self, output: RequestOutput) -> None:
        reason = output.outputs[0].finish_reason or "stop"
        self.metrics.record_finished(FinishedRequestStats(
            finished_reason=reason,
            arrival_time=output.metrics.arrival_time,
            first_scheduled_time=output.metrics.first_scheduled_time,
            finished_time=output.metrics.finished_time or time.time(),
            num_prompt_tokens=len(output.prompt_token_ids),
            num_generation_tokens=sum(len(c.token_ids) for c in output.outputs),
        ))

    def _append_token(
        self, seq: Sequence, token_id: int, logprobs: SampleLogprobs | None, now: float
    ) -> None:
        """Record a sampled token and decide whether the sequence is done (vLLM's stop rules)."""
        token_ids = seq.token_ids
        token_ids.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._ttfts.append(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            self._itls.append(now - seq.last_token_time)
        seq.last_token_time = now
        if logprobs is not None:
            seq.logprobs.append(self._logprob_entry(token_id, logprobs))
            seq.cumulative_logprob += logprobs.logprob
        params = seq.params
        num_tokens = len(token_ids)
        # EOS and stop token ids are masked before min_tokens; stop strings are ignored there too.
        may_stop = num_tokens - seq.num_prompt_tokens > params.min_tokens
        status = None  # the finished status, once decided
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif may_stop and params.stop_token_ids and token_id in params.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token_id
        stop_string = seq.detokenizer.update(token_ids, stop_terminated=status is not None, check_stop=may_stop)
        if status is None and stop_string is not None:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_string
        if status is None and (
            num_tokens - seq.num_prompt_tokens >= seq.max_tokens or num_tokens >= self.max_model_len
        ):
            status = SequenceStatus.FINISHED_LENGTH_CAPPED
        if status is not None:
            seq.status = status
            seq.finished_time = now

    def _logprob_entry(self, token_id: int, figures: SampleLogprobs) -> dict[int, Logprob]:
        ids = [token_id, *figures.top_token_ids]
        texts = self.tokenizer.batch_decode([[i] for i in ids])
        entry = {token_id: Logprob(figures.logprob, figures.rank, texts[0])}
        for rank, (tid, lp, text) in enumerate(
            zip(figures.top_token_ids, figures.top_logprobs, texts[1:], strict=True), start=1
        ):
            entry.setdefault(tid, Logprob(lp, rank, text))
        return entry

    def _make_output(self, request: _Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            finished = seq.is_finished
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.text(finished=finished),
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.status.finish_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    cumulative_logprob=seq.cumulative_logprob,
                    stop_reason=seq.stop_reason,
                )
            )
        first = request.seqs[0]
        finished_times = [s.finished_time for s in request.seqs]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=outputs,
            finished=all(s.is_finished for s in request.seqs),
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=min(
                    (s.first_scheduled_time for s in request.seqs if s.first_scheduled_time is not None),
                    default=None,
                ),
                first_token_time=min(
                    (s.first_token_time for s in request.seqs if s.first_token_time is not None), default=None
                ),
                finished_time=None if None in finished_times else max(finished_times),
            ),
        )

    # --- figures -------------------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        """Current figures for metrics exporters."""
        bm, cache = self.block_manager, self.block_manager.stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_used_blocks=bm.num_used_blocks,
            num_total_blocks=bm.num_total_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            prefix_cache_block_queries=cache.block_queries,
            prefix_cache_block_hits=cache.block_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            step_prompt_tokens=self._step_prompt_tokens,
            step_generation_tokens=self._step_generation_tokens,
            num_steps=self._num_steps,
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block; False if requests still hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's resolved max_tokens, after checking it fits the context and the KV pool."""
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt: {prompt_len} tokens leave no room to generate within max_model_len="
                f"{self.max_model_len}; shorten the prompt"
            )
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}; lower max_tokens to at most {room}"
            )
        # The last sampled token is never computed, so a sequence holds at most prompt + max_tokens - 1.
        blocks_needed = cdiv(prompt_len + max_tokens - 1, self.config.block_size)
        if blocks_needed > self.block_manager.num_total_blocks:
            capacity = self.block_manager.num_total_blocks * self.config.block_size
            raise ValueError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) does not fit the KV "
                f"cache ({capacity} tokens); lower max_tokens or raise num_kv_blocks / kv_cache_memory_bytes"
            )
        return max_tokens


def _resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if model_max is None:
            raise ValueError("max_model_len: the model config has no max_position_embeddings; set it")
        return int(model_max)
    if model_max is not None and config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len: {config.max_model_len} exceeds the model's max_position_embeddings ({model_max})"
        )
    return config.max_model_len


def _eos_token_ids(model_path: Path, hf_config: Any, tokenizer: Any) -> set[int]:
    """EOS ids of the model config, generation_config.json and the tokenizer, together (HF generate's set)."""
    values = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    if (model_path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        values.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    found: set[int] = set()
    for value in values:
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list | tuple):
            found.update(v for v in value if isinstance(v, int))
    return found


class LLM:
    """Offline batch inference: LLM(model, **engine options).generate(prompts, sampling_params)."""

    _ids = itertools.count()

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        unknown = sorted(set(engine_kwargs) - set(EngineConfig.field_names()))
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: unknown engine option; valid: {EngineConfig.field_names()}"
            )
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))

    def get_tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); the LLM is unusable afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt (text or token ids)
        token_ids = []
        for i, prompt in enumerate(prompts):
            try:
                token_ids.append(self.engine.tokenize(prompt))
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
        outputs = self._run(token_ids, sampling_params, use_tqdm=use_tqdm)
        for output, prompt in zip(outputs, prompts, strict=True):
            output.prompt = prompt if isinstance(prompt, str) else None
        return outputs

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model: {self.engine.config.model!r} has no chat template; use generate()")
        texts = [
            tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        # The template already holds BOS and friends: encode without adding them again.
        token_ids = [self.engine.tokenize(text, add_special_tokens=False) for text in texts]
        outputs = self._run(token_ids, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def _run(
        self,
        token_ids: list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        *,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(token_ids):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(token_ids)} prompts; "
                    "pass one, or one per prompt"
                )
            params_list = sampling_params
        else:
            params_list = [sampling_params or SamplingParams()] * len(token_ids)

        # Prefix-aware order, computed once: prompts sorted by token ids, so prompts sharing a prefix are
        # admitted next to each other and hit each other's blocks. FCFS afterwards, so nobody starves.
        order = sorted(range(len(token_ids)), key=token_ids.__getitem__)
        request_ids = {i: f"llm-{next(self._ids)}" for i in order}
        added: list[str] = []
        try:
            for i in order:
                self.engine.add_request(request_ids[i], token_ids[i], params_list[i])
                added.append(request_ids[i])
        except ValueError as exc:
            for request_id in added:
                self.engine.abort(request_id)
            raise ValueError(f"prompts[{i}]: {exc}") from None

        wanted = set(added)
        results: dict[str, RequestOutput] = {}
        with _progress(len(added), enabled=use_tqdm) as advance:
            while len(results) < len(added):
                if not self.engine.has_unfinished():
                    raise RuntimeError("engine drained before every request finished")
                for output in self.engine.step():
                    if output.request_id in wanted:
                        results[output.request_id] = output
                        advance()
        return [results[request_ids[i]] for i in range(len(token_ids))]


@contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Callable[[], None]]:
    """A rich progress bar over finished requests, or a no-op."""
    if not enabled:
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress() as bar:
        task = bar.add_task("generating", total=total)
        yield lambda: bar.advance(task)
