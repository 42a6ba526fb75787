"""ModelRunner: owns the model and its paged KV cache; turns a scheduled batch into logits.

One step (ARCHITECTURE.md, contract 3) packs all sequences' new tokens into one flat batch with the layout
tensors the attention layers read from the per-step context (step_batch.py).

CPU runs the torch attention path and never touches CUDA; its packed weights and KV cache sit on huge pages
where the system grants them (huge_pages.py). CUDA runs the Triton kernels, sizes the KV cache from
gpu_memory_utilization after a profiling forward at max_num_batched_tokens, and replays CUDA graphs
captured at start for decode-only steps (batch sizes 1, 2, 4, 8, ... up to max_num_seqs; cuda_graphs.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.amx_linear import with_high_precision
from batchinfer.engine.layers.attention import Attention
from batchinfer.engine.layers.context import set_context
from batchinfer.engine.layers.exact_blocks import exact_blocks_source, pack_exact_blocks
from batchinfer.engine.layers.greedy_head import GreedyHead
from batchinfer.engine.layers.kv_quant import kv_cache_format
from batchinfer.engine.layers.quantization import pack_weights, quantization_format
from batchinfer.engine.layers.quantized_attention import QuantizedKV
from batchinfer.engine.models import get_model_class
from batchinfer.engine.models.loader import load_weights
from batchinfer.engine.models.resolved_model import ResolvedModel, resolve_model
from batchinfer.engine.parallel.distributed import all_reduce_min_int
from batchinfer.engine.worker.cuda_graphs import DecodeGraphs
from batchinfer.engine.worker.embed_forward import embed_batched
from batchinfer.engine.worker.huge_pages import huge_page_zeros, place_packed_weights
from batchinfer.engine.worker.native_step import NativeStep
from batchinfer.engine.worker.step_batch import StepBatch, build_step_batch
from batchinfer.engine.worker.step_budget import step_token_budget

if TYPE_CHECKING:  # the one architecture; imported for types only
    from batchinfer.engine.lora.request import LoRARequest
    from batchinfer.engine.models.llama import LlamaForCausalLM
    from batchinfer.engine.worker.runner_protocol import ScheduledSequence

logger = logging.getLogger(__name__)


@dataclass
class _ProfileSeq:
    """Stand-in sequence for the profiling forward (the Sequence fields the runner reads)."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int = 0
    lora_request: LoRARequest | None = None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def resolve_attention_backend(requested: str, device: torch.device) -> str:
    """'torch' or 'triton' for EngineConfig.attention_backend on this device."""
    if requested == "auto":
        if device.type != "cuda":
            return "torch"
        import batchinfer.kernels as kernels

        return "triton" if kernels.TRITON_AVAILABLE else "torch"
    return requested


class ModelRunner:
    """Loads the model, allocates the KV cache, and runs one scheduled step at a time."""

    def __init__(self, config: EngineConfig, model: ResolvedModel | None = None, *,
                 screen_greedy_rows: bool = True) -> None:
        """model: resolved by the Engine; None resolves config.model here (a runner on its own).

        screen_greedy_rows: give a float32 head its greedy screen (False where no caller names argmax-only
        rows: a draft model, a pipeline stage).
        """
        if model is None:
            model = resolve_model(config, with_tokenizer=False)
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = config.resolved_dtype()
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        self.model_path = model.path
        # quantization="gguf" runs the file's own blocks: checked before any weight is loaded
        self.gguf_path = quantization_format(config.quantization).weight_source(config.model)
        self.hf_config = model.hf_config
        self.max_model_len = model.max_model_len
        # tokens per forward (the Engine's scheduler, the embeddings, a draft's catch-up): step_budget.py
        self.step_tokens = step_token_budget(config.max_num_batched_tokens, hf_config=self.hf_config,
                                             dtype=self.dtype, device=self.device,
                                             tensor_parallel_size=config.tensor_parallel_size)
        self.block_size = config.block_size
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        # Decode tokens on CPU (fp32/bf16) go to the native kernel (built here, once, rather than mid-step).
        # None: the cache holds the model dtype ("auto" is u8 under bfloat16 or int8 weights on CPU)
        self.kv_format = kv_cache_format(config.resolved_kv_cache_dtype(), self.dtype)
        if self.kv_format is not None and self.attention_backend != "torch":
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r}: needs the torch attention backend "
                             "(CPU)")
        # A quantized cache's decode tokens too, where the kernel reads its codes (int8 / u8).
        self.native_decode = self.attention_backend == "torch" and self.device.type == "cpu" and (
            cpu_attention.supports(self.dtype) if self.kv_format is None
            else cpu_attention.supports_quantized(self.kv_format.storage, self.dtype))
        self.model = self._build_model()
        pack_weights(self.model, self.device, config.quantization,  # CPU: oneDNN / int8 / GGUF 4-bit kernels
                     model_path=self.model_path, max_model_len=self.max_model_len,
                     gguf_path=self.gguf_path)
        # float32 GEMMs on AMX (layers/amx_linear.py): "high" runs every step's in bf16x3; "auto" its
        # embeddings only (embed() gives the layers that kernel on first use)
        self.float32_matmul_precision = config.resolved_float32_matmul_precision()
        # a GGUF model's float32 linears on AMX over the file's exact 4-bit blocks (layers/exact_blocks.py),
        # under every precision; "high" leaves them (no dense weight to replace them with), "auto" keeps the
        # file's blocks for its embeddings' bf16x3
        blocks_source = exact_blocks_source(
            model=config.model, dtype=self.dtype, device=self.device, quantization=config.quantization,
            ranks=config.tensor_parallel_size * config.pipeline_parallel_size)
        if blocks_source is not None:
            pack_exact_blocks(self.model, blocks_source, keep_blocks=self.float32_matmul_precision == "auto")
        self._embeddings_packed = False  # "auto": embed() has given the layers their bf16x3 kernel
        if self.float32_matmul_precision == "high":
            with_high_precision(self.model, replace=True)
        if self.device.type == "cpu":  # before the native step takes the packs (huge_pages.py)
            place_packed_weights(self.model)
        # a float32 head's greedy rows screened by its bf16 GEMM (layers/greedy_head.py; None: not here)
        self.greedy_head = None if self.float32_matmul_precision == "high" or not screen_greedy_rows else (
            GreedyHead.build(getattr(self.model, "lm_head", None), dtype=self.dtype, device=self.device,
                             quantization=config.quantization,
                             tensor_parallel_size=config.tensor_parallel_size))
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.lora_manager = None  # adapters' weights and each step's LoRABatch, when LoRA is enabled
        if config.enable_lora:
            from batchinfer.engine.lora.manager import LoRAManager

            if config.max_cpu_loras is None:  # EngineConfig.__post_init__ sets it (default max_loras)
                raise ValueError("max_cpu_loras: unset; build the config through EngineConfig")

            self.lora_manager = LoRAManager(self.hf_config, max_lora_rank=config.max_lora_rank,
                                            max_cpu_loras=config.max_cpu_loras, dtype=self.dtype,
                                            device=self.device)
            self.lora_manager.attach(self.model)
        first = self.attention_layers[0]
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        row_bytes = (self.head_dim * self.dtype.itemsize if self.kv_format is None
                     else self.kv_format.bytes_per_row(self.head_dim))
        self.block_bytes = 2 * len(self.attention_layers) * self.block_size * self.num_kv_heads * row_bytes
        self.decode_graphs = DecodeGraphs(max_num_seqs=config.max_num_seqs,
                                          max_blocks_per_seq=self.max_blocks_per_seq,
                                          max_model_len=self.max_model_len)  # captured below on CUDA
        if config.num_kv_blocks is not None:
            self.num_kv_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            self.num_kv_blocks = self._profile_num_kv_blocks()
        else:
            self.num_kv_blocks = config.kv_cache_memory_bytes // self.block_bytes
        # Tensor parallelism: every rank's KV shard must have the same blocks (the smallest rank's count).
        self.num_kv_blocks = all_reduce_min_int(self.num_kv_blocks, self.device)
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block of {self.block_bytes} bytes; raise "
                "kv_cache_memory_bytes (CPU), gpu_memory_utilization (CUDA) or set num_kv_blocks"
            )
        self.kv_cache: torch.Tensor | None = self._allocate_kv_cache(self.num_kv_blocks)  # None: released
        # CPU: the decoder stack of a step as one C++ call (None: the Python layer loop runs it)
        self.native_step = (None if config.enable_lora or self.attention_backend != "torch"
                            else NativeStep.build(self.model, self.dtype, self.device))
        if self.device.type == "cuda" and self.attention_backend == "triton" and not config.enforce_eager:
            self.decode_graphs.capture(self.model, hidden_size=self.hf_config.hidden_size, dtype=self.dtype,
                                       device=self.device)

    def _build_model(self) -> torch.nn.Module:
        """The model with its weights loaded, on this runner's device and dtype (a stage overrides it)."""
        model_cls = get_model_class(self.hf_config)
        with _default_dtype(self.dtype), torch.device(self.device):
            model = model_cls(self.hf_config, self.max_model_len)
        load_weights(model, self.model_path)
        return model.eval()

    def close(self) -> None:
        """Nothing outlives a step on one rank (ModelRunnerProtocol's close)."""

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check a request's adapter (lora.adapter.LoRAError if it cannot run on this model)."""
        if self.lora_manager is None:
            raise ValueError("lora_request: this engine was started without enable_lora")
        self.lora_manager.add(lora_request)

    # --- KV cache -------------------------------------------------------------------------------------

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """[layers, 2, num_blocks, block_size, Hkv, D], bound per layer as k_cache/v_cache views.

        Zero-filled: the torch path reads padding slots under a -inf mask, and uninitialized memory may hold
        NaN bit patterns, which survive the mask (NaN + -inf = NaN) and would poison the softmax.
        """
        fmt = self.kv_format
        layers = len(self.attention_layers)
        shape = (layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        params_shape = None if fmt is None or not fmt.num_params else (*shape[:-1], fmt.num_params)
        dtype = self.dtype if fmt is None else fmt.storage
        cache = self._zeros(shape, dtype)
        params = None if params_shape is None else self._zeros(params_shape, torch.float32)
        for layer, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = cache[layer, 0], cache[layer, 1]
            if fmt is not None:
                attn.quantized_kv = QuantizedKV(fmt, cache[layer, 0], cache[layer, 1],
                                                None if params is None else params[layer, 0],
                                                None if params is None else params[layer, 1])
        return cache

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled cache tensor (on a CPU: on huge pages where granted, huge_pages.py)."""
        if self.device.type == "cpu":
            return huge_page_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _profile_num_kv_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization after the weights and a max_num_batched_tokens step."""
        config = self.config
        num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens))
        seq_len = min(self.max_model_len, max(1, config.max_num_batched_tokens // num_seqs))
        blocks_per_seq = math.ceil(seq_len / self.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocate_kv_cache(num_seqs * blocks_per_seq)
        seqs = [
            _ProfileSeq([0] * seq_len, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
            for i in range(num_seqs)
        ]
        self.execute_model([(seq, seq_len) for seq in seqs])
        torch.cuda.synchronize(self.device)
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        # used: everything on the device now (weights, CUDA context, other processes); peak - current: the
        # activations of the profiling step, which every later step may need again.
        budget = total * config.gpu_memory_utilization - (total - free) - (peak - current)
        if config.enable_lora:  # room for the adapters kept loaded (they come after this profile)
            from batchinfer.engine.lora.adapter import max_adapter_bytes

            if config.max_cpu_loras is None:  # EngineConfig.__post_init__ sets it (default max_loras)
                raise ValueError("max_cpu_loras: unset; build the config through EngineConfig")

            budget -= config.max_cpu_loras * max_adapter_bytes(
                self.hf_config, max_lora_rank=config.max_lora_rank, itemsize=self.dtype.itemsize,
                tp_size=config.tensor_parallel_size)
        num_blocks = int(budget) // self.block_bytes
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.block_bytes / 2**30)
        return num_blocks

    # --- one step -------------------------------------------------------------------------------------

    def _prepare(
        self, scheduled: Sequence[tuple[ScheduledSequence, int]], logits_counts: Sequence[int] | None = None
    ) -> StepBatch:
        return build_step_batch(
            scheduled, logits_counts, block_size=self.block_size, max_model_len=self.max_model_len,
            attention_backend=self.attention_backend, native_decode=self.native_decode, dtype=self.dtype,
            device=self.device, lora_manager=self.lora_manager,
        )

    @torch.inference_mode()
    def execute_model(
        self, scheduled: Sequence[tuple[ScheduledSequence, int]], logits_counts: Sequence[int] | None = None,
        *, argmax_only_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """Run one step; float32 logits of each entry's last scheduled token.

        logits_counts[i] (default 1 each) asks for the logits of entry i's last c scheduled tokens instead:
        the rows come back in batch order, entry by entry, [sum(logits_counts), vocab]. argmax_only_rows: rows
        whose reader takes only the argmax, which may come back screened (ModelRunnerProtocol).
        """
        if not scheduled:
            return torch.empty(0, self.hf_config.vocab_size, dtype=torch.float32, device=self.device)
        batch = self._prepare(scheduled, logits_counts)
        graph_size = self.decode_graphs.size_for(batch.context, num_seqs=batch.num_seqs,
                                                 decode_only=batch.is_decode_only)
        if graph_size is not None:
            hidden = self.decode_graphs.replay(batch.input_ids, batch.positions, batch.context,
                                               num_seqs=batch.num_seqs, size=graph_size)
        else:
            set_context(batch.context)
            try:
                if self.native_step is not None:
                    hidden = self.native_step.forward(batch.input_ids, batch.positions, batch.context)
                else:
                    hidden = self.model(batch.input_ids, batch.positions)
            finally:
                set_context(None)
            hidden = hidden.index_select(0, batch.logits_indices)
        head = cast("LlamaForCausalLM", self.model).compute_logits
        if self.greedy_head is not None and argmax_only_rows:
            return self.greedy_head.logits(hidden, argmax_only_rows, head)
        return head(hidden).float()

    @torch.inference_mode()
    def embed(self, token_id_lists: Sequence[list[int]]) -> list[list[float]]:
        """Each input's last hidden state (after the final norm), mean-pooled over its tokens, L2-normalised.

        Packed cache-free forwards of up to step_tokens tokens (embed_forward.py; max_num_batched_tokens,
        on a CPU step_budget.py's cut): the KV cache, block tables and prefix cache are not touched.
        float32_matmul_precision "auto" on an AMX CPU runs their float32 GEMMs in bf16x3 (amx_linear.py).
        """
        high = self.float32_matmul_precision == "auto"
        if high and not self._embeddings_packed:  # the first embeddings give the layers their bf16x3 kernel
            self._embeddings_packed = True
            with_high_precision(self.model)
        return embed_batched(self.model, token_id_lists, self.device, self.step_tokens,
                             float32_matmul_high=high)

