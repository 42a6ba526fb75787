"""The engine loop: Engine.add_request / step / abort over one model.

step() = schedule -> model_runner.execute_model -> sample the sequences whose scheduled chunk reached
their last token -> append tokens, advance num_computed_tokens, detokenize and check stops (stop.py) ->
free the finished. Validation happens in add_request before any state changes, so a bad request raises a
ValueError naming the field and leaves the engine and every other request untouched. Outputs are built
in outputs.py, figures kept in metrics.py; the offline LLM API over this loop is llm.py.

Structured output (structured_requests.py): a constrained request waits outside the scheduler until its
grammar is compiled; each step masks the constrained rows, each accepted token advances the row's matcher.

Speculative decoding (spec_decode/): the scheduler gives a decoding sequence lookahead slots, the
Speculator proposes drafts for it, the drafts run as part of its chunk (k + 1 logits rows), and the
accepted tokens are appended one by one through _append_token like sampled ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as AbstractSequence
from collections.abc import Set as AbstractSet
from itertools import accumulate

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.core.block_manager import BlockManager
from batchinfer.engine.core.detokenizer import IncrementalDetokenizer
from batchinfer.engine.core.request_checks import check_param_token_ids, prompt_token_ids, resolved_max_tokens
from batchinfer.engine.core.scheduler import Scheduler
from batchinfer.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from batchinfer.engine.lora.request import LoRARequest
from batchinfer.engine.metrics import EngineStats, MetricsRecorder
from batchinfer.engine.models.resolved_model import resolve_model
from batchinfer.engine.native.threads import ThreadGovernor, cpu_thread_governor
from batchinfer.engine.outputs import RequestOutput, make_logprob_entry, make_request_output
from batchinfer.engine.parallel.executor import make_model_runner
from batchinfer.engine.sampling import prompt_logprobs
from batchinfer.engine.sampling.logits_controls import bad_words_token_ids
from batchinfer.engine.sampling.sampler import SampleLogprobs, Sampler, reads_only_argmax
from batchinfer.engine.sampling.stop import check_stop
from batchinfer.engine.sampling.structured import GrammarBackend, GrammarState
from batchinfer.engine.sampling.structured_requests import StructuredRequests
from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.engine.spec_decode.speculator import Speculator
from batchinfer.engine.worker.runner_protocol import ModelRunnerProtocol

logger = logging.getLogger(__name__)


class Engine:
    """A continuously batching engine over one model: add requests, call step() until done."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Resolved once, here; the runners take it. A bad max_model_len fails before any weight is loaded.
        model = self.resolved_model = resolve_model(config)
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.tokenizer = model.tokenizer
        self.eos_token_ids: AbstractSet[int] = model.eos_token_ids
        self.model_runner: ModelRunnerProtocol = make_model_runner(config, model)
        self.block_manager = BlockManager(
            self.model_runner.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            namespace=config.model,
        )
        self.scheduler = Scheduler(config, self.block_manager, max_model_len=self.max_model_len,
                                   max_num_batched_tokens=self.model_runner.step_tokens)
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            self.speculator = Speculator(config.speculative_config, config,
                                         num_kv_blocks=self.model_runner.num_kv_blocks,
                                         vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        self.sampler = Sampler(seed=config.seed, device=self.model_runner.device)
        self.recorder = MetricsRecorder(config.model, self.scheduler, self.block_manager)
        if self.speculator is not None:
            from batchinfer.engine.spec_decode.metrics import SpecDecodeMetrics

            self.recorder.spec_counts = self.speculator.counts
            self.recorder.spec_metrics = SpecDecodeMetrics(self.recorder.metrics.labels,
                                                           self.speculator.spec.num_speculative_tokens)
        if config.enable_lora:
            from batchinfer.engine.lora.metrics import LoRAMetrics

            self.recorder.lora_metrics = LoRAMetrics(self.recorder.metrics.labels, config.max_loras)
        self._requests: dict[str, SequenceGroup] = {}
        # decode([token id]) per skip_special_tokens value, shared by every sequence's detokenizer
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}
        # This step's latencies, handed to the recorder by _record_step (appended per token: kept lean).
        self._ttfts: list[float] = []
        self._itls: list[float] = []
        self.structured = StructuredRequests(  # constrained requests and their grammars
            config, self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
            device=self.model_runner.device)
        self._prompt_logprob_requests: set[str] = set()  # whose prompt logprobs are still being computed
        self.thread_governor: ThreadGovernor | None = None
        if str(self.model_runner.device) == "cpu":
            self.thread_governor, threads = cpu_thread_governor(
                adaptive=config.adaptive_threads,
                ranks=config.tensor_parallel_size * config.pipeline_parallel_size)
            self.recorder.metrics.record_cpu_threads(threads)

    def close(self) -> None:
        """Release what outlives a step: tensor-parallel worker processes, the grammar compile thread."""
        if self.thread_governor is not None:
            self.thread_governor.restore()  # a later engine in this process starts from the same count
        self.model_runner.close()
        if self.speculator is not None:
            self.speculator.close()
        self.structured.close()

    @property
    def grammar_backend(self) -> GrammarBackend | None:
        """The grammar backend, once a constrained request made it."""
        return self.structured.backend

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field (engine state unchanged).

        lora_request: the PEFT adapter the request runs under (enable_lora); loaded and checked here.
        """
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
        if lora_request is not None:
            self._add_lora(lora_request)
        prompt_token_ids = self.tokenize(prompt, add_special_tokens=add_special_tokens)
        if params.truncate_prompt_tokens is not None:  # vLLM: keep the prompt's last k tokens
            prompt_token_ids = prompt_token_ids[-params.truncate_prompt_tokens:]
        max_tokens = resolved_max_tokens(len(prompt_token_ids), params, max_model_len=self.max_model_len,
                                         block_size=self.config.block_size,
                                         num_blocks=self.block_manager.num_total_blocks)
        check_param_token_ids(params, vocab_size=self.vocab_size)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        compiled = None
        if params.structured_outputs is not None:
            compiled = self.structured.compile(params.structured_outputs, owner=cache_salt)  # fair turns

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
                lora_request=lora_request,
            )
            for i in range(params.n)
        ]
        for seq in seqs:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.num_prompt_tokens, params,
                token_texts=self._token_texts[params.skip_special_tokens],
            )
            seq.bad_words_token_ids = bad_words
            if compiled is not None:
                seq.grammar = GrammarState(compiled)
        text = prompt if isinstance(prompt, str) else None
        group = self._requests[request_id] = SequenceGroup(request_id, text, prompt_token_ids, seqs, arrival)
        if seqs[0].needs_prompt_logprobs:
            self._prompt_logprob_requests.add(request_id)
        if compiled is None or compiled.done():
            self._queue(group)
        else:
            self.structured.hold(group)

    def _add_lora(self, lora_request: LoRARequest) -> None:
        """Load a request's adapter on the runner (ValueError naming the problem if it cannot run)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest; got {type(lora_request).__name__}")
        if not self.config.enable_lora:
            raise ValueError("lora_request: this engine was started without enable_lora "
                             "(LLM(model, enable_lora=True), or --lora-modules)")
        self.model_runner.add_lora(lora_request)

    def _queue(self, group: SequenceGroup) -> None:
        """Hand a request's sequences to the scheduler (a constrained one's grammar is compiled by now)."""
        self.structured.start(group)
        for seq in group.seqs:
            self.scheduler.add(seq)  # siblings queue side by side, so they share the prompt's blocks

    def _queue_compiled(self) -> list[RequestOutput]:
        """Queue the held requests whose grammar is compiled; returns those whose compile failed."""
        ready, failed = self.structured.take_compiled()
        for group in ready:
            self._queue(group)
        return [self._finish_unqueued(group, error=error) for group, error in failed]

    def _finish_unqueued(self, group: SequenceGroup, *, error: str | None = None) -> RequestOutput:
        """Abort a request that never reached the scheduler; returns its final output (with `error`)."""
        now = time.time()
        for seq in group.seqs:
            seq.status = SequenceStatus.FINISHED_ABORTED
            seq.finished_time = now
        self._requests.pop(group.request_id, None)
        self._prompt_logprob_requests.discard(group.request_id)
        output = make_request_output(group)
        output.error = error
        self.recorder.record_finished(output)
        return output

    def tokenize(self, prompt: str | list[int], *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt given as text or ids (ids are checked against the vocabulary)."""
        return prompt_token_ids(self.tokenizer, prompt, vocab_size=self.vocab_size,
                                add_special_tokens=add_special_tokens)

    def embed(self, inputs: AbstractSequence[str | list[int]], *, first_index: int = 0, label: str = "input"
              ) -> tuple[list[list[float]], int]:
        """(each input's normalised mean-pooled embedding, tokens read); outside the generation batch.

        All inputs go to the runner at once: it packs them into forwards of up to max_num_batched_tokens
        (fewer on a CPU: worker/step_budget.py).

        first_index: the position of inputs[0] in its line (error messages name label[first_index + i]).
        A runner that cannot pool (pipeline stages) raises ValueError naming the setting."""
        token_id_lists = [self.tokenize(text) for text in inputs]
        for i, ids in enumerate(token_id_lists, start=first_index):
            if len(ids) > self.max_model_len:
                raise ValueError(f"{label}[{i}]: {len(ids)} tokens exceed the model's context "
                                 f"(max_model_len={self.max_model_len}); shorten the input")
        return self.model_runner.embed(token_id_lists), sum(map(len, token_id_lists))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its final output (None if unknown)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if self.structured.drop(request):  # never reached the scheduler
            return self._finish_unqueued(request)
        del self._requests[request_id]
        self._prompt_logprob_requests.discard(request_id)
        now = time.time()
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq)
                seq.finished_time = now
        output = make_request_output(request)
        self.recorder.record_finished(output)
        return output

    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""
        return bool(self._requests)

    def get_num_unfinished(self) -> int:
        """Requests queued or running."""
        return len(self._requests)

    def request_progress(self, request_id: str) -> tuple[int, int] | None:
        """(tokens generated so far, the most it may generate) over an unfinished request's n sequences."""
        group = self._requests.get(request_id)
        if group is None:
            return None
        return sum(seq.num_output_tokens for seq in group.seqs), sum(seq.max_tokens for seq in group.seqs)

    # --- the loop ------------------------------------------------------------------------------------

    def step(self, *, include_unfinished: bool = False) -> list[RequestOutput]:
        """Run one iteration; returns the requests that finished (and, if asked, those that progressed)."""
        recorder = self.recorder
        outputs = self._queue_compiled() if self.structured.awaiting else []
        schedule = self.scheduler.schedule()
        scheduled = schedule.scheduled
        speculative = None
        if self.speculator is not None:
            if schedule.preempted:
                self.speculator.forget(schedule.preempted)
            if schedule.lookahead:
                speculative = self.speculator.propose(scheduled, schedule.lookahead)
        if not scheduled:
            recorder.count_tokens(0, 0)
            if self.structured.awaiting and not self.scheduler.has_unfinished():
                self.structured.wait_for_one()  # nothing to run but compiles: wait for one, do not spin
            return outputs  # or everything runnable was preempted this step; it is readmitted on the next
        recorder.num_steps += 1
        if self.thread_governor is not None:
            recorder.metrics.record_cpu_threads(self.thread_governor.tick())
        scheduled_time = time.time()
        counts = prompt_logprobs.logits_counts(scheduled) if self._prompt_logprob_requests else None
        if speculative is None:
            # plain greedy rows: a float32 head may screen them (layers/greedy_head.py)
            plain = [] if counts else [i for i, (seq, _) in enumerate(scheduled) if reads_only_argmax(seq)]
            logits = self.model_runner.execute_model(scheduled, counts, argmax_only_rows=plain)
        else:  # the drafts run as part of their sequence's chunk; k + 1 logits rows each
            counts = speculative.logits_counts(counts, len(scheduled))
            with speculative.drafts_in_token_ids():
                logits = self.model_runner.execute_model(speculative.grown(scheduled), counts)
        ends = None if counts is None else list(accumulate(counts))  # entry i's logits end at row ends[i]

        rows: list[int] = []
        prompt_tokens = 0
        for row, (seq, num_new) in enumerate(scheduled):  # per sequence per step: keep it lean
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = scheduled_time
            start = seq.num_computed_tokens
            end = start + num_new
            if start < seq.num_prompt_tokens:
                prompt_tokens += min(end, seq.num_prompt_tokens) - start
            if ends is not None and seq.needs_prompt_logprobs:
                prompt_logprobs.collect(seq, start, logits[ends[row] - num_new : ends[row]], self.tokenizer)
                if not seq.needs_prompt_logprobs:
                    self._prompt_logprob_requests.discard(seq.request_id)
            seq.num_computed_tokens = end
            if end == len(seq.token_ids):  # the chunk reached the end: sample
                rows.append(row)

        progressed: dict[str, SequenceGroup] = {}  # requests to report: with a finished sequence, or all
        num_generated = len(rows)
        if speculative is not None:
            assert self.speculator is not None and ends is not None
            appended, spec_seqs = self.speculator.verify_and_append(
                speculative, logits, ends, self.sampler, self.eos_token_ids, self._append_token)
            num_generated += appended - len(spec_seqs)
            for seq in spec_seqs:
                if include_unfinished or seq.is_finished:
                    progressed[seq.request_id] = self._requests[seq.request_id]
            rows = [row for row in rows if row not in speculative.proposals]
        if rows:
            seqs = [scheduled[row][0] for row in rows]
            grammar = self.structured.mask(seqs)
            # A decode step samples every row: skip the [rows, vocab] gather copy (tens of MB at vocab 49k).
            if ends is not None:
                logits = logits[[ends[row] - 1 for row in rows]]
            elif len(rows) != len(scheduled):
                logits = logits[rows]
            sampled = self.sampler(logits, seqs, self.eos_token_ids, grammar)
            now = time.time()  # the tokens exist from here: first-token, inter-token and finish times
            for seq, token_id, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
                self._append_token(seq, token_id, logprobs, now)
                if include_unfinished or seq.is_finished:
                    progressed[seq.request_id] = self._requests[seq.request_id]
        recorder.count_tokens(prompt_tokens, num_generated)
        self.scheduler.free_finished()

        for request in progressed.values():
            finished = request.is_finished
            if finished:
                del self._requests[request.request_id]
            if finished or include_unfinished:
                outputs.append(make_request_output(request))
            if finished:
                recorder.record_finished(outputs[-1])
        self._record_step()
        return outputs

    def _record_step(self) -> None:
        """Fold this step into the metrics (bench/engine_overhead.py swaps this out to time it)."""
        self.recorder.record_step(self._ttfts, self._itls)
        self._ttfts, self._itls = [], []

    def _append_token(
        self, seq: Sequence, token_id: int, logprobs: SampleLogprobs | None, now: float
    ) -> None:
        """Record a sampled token, its latency and logprobs, then apply the stop rules."""
        seq.token_ids.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._ttfts.append(now - seq.arrival_time)
        elif seq.last_token_time is not None and now != seq.last_token_time:  # once per step (speculation)
            self._itls.append(now - seq.last_token_time)
        seq.last_token_time = now
        if logprobs is not None:
            if seq.logprobs is None or seq.cumulative_logprob is None:
                raise RuntimeError("logprobs sampled for a sequence that did not ask for them")
            seq.logprobs.append(make_logprob_entry(self.tokenizer, token_id, logprobs))
            seq.cumulative_logprob += logprobs.logprob
        finished = check_stop(seq, token_id, self.eos_token_ids, self.max_model_len)
        if seq.grammar is not None and not finished:
            finished = self.structured.accept(seq, token_id)
        if finished:
            seq.finished_time = now

    # --- figures -------------------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        """Current figures for metrics exporters."""
        return self.recorder.engine_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block; False if requests still hold blocks."""
        return self.block_manager.reset_prefix_cache()
