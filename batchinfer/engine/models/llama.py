"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral, SmolLM2) written for the paged KV cache.

Module names mirror Hugging Face's checkpoints except for the fused projections, which the loader fills
from the separate checkpoint tensors through `packed_modules_mapping` (q/k/v -> qkv_proj, gate/up ->
gate_up_proj). The forward takes packed tokens of all sequences ([T] ids and positions); the batch layout
(slot_mapping, block tables, ...) reaches the attention layers through the per-step context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batchinfer.engine.layers.activation import SiluAndMul
from batchinfer.engine.layers.attention import Attention
from batchinfer.engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from batchinfer.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from batchinfer.engine.layers.norm import RMSNorm
from batchinfer.engine.layers.rotary import apply_rotary, get_rope, rotate_qkv_
from batchinfer.engine.models.pipeline_stage import MissingLayer, PipelineStage

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o_proj): Qwen2 always biases q/k/v only; Llama follows attention_bias."""
    if config.model_type == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window the config actually enables (None: full attention in every layer)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, rotary embedding, paged attention, output projection."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.head_dim = _head_dim(config)
        qkv_bias, o_bias = _attention_biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            qkv_bias,
        )
        # This rank's heads (tensor parallelism splits Q heads, and splits or replicates KV heads).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, o_bias
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; rope: the step's (cos, sin) of each token's position."""
        qkv = self.qkv_proj(hidden_states)
        rotated = rotate_qkv_(qkv, *rope, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so the add fuses into the next norm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); their sum is the layer's output."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; a pipeline stage builds only its part of them."""

    def __init__(
        self, config: PretrainedConfig, max_position: int, stage: PipelineStage | None = None
    ) -> None:
        super().__init__()
        self.stage = stage or PipelineStage.whole(config.num_hidden_layers)
        # The last stage of a tied model keeps the table too: it is that stage's LM head.
        if self.stage.is_first or (self.stage.is_last and getattr(config, "tie_word_embeddings", False)):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = get_rope(config, _head_dim(config), max_position)  # buffers only, no weights
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) if self.stage.start <= i < self.stage.end else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.stage_layers = tuple(self.layers[self.stage.start : self.stage.end])  # sliced once, not per step
        if self.stage.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T] ids at [T] positions -> final hidden states [T, hidden].

        A later pipeline stage starts from hidden_states, the residual stream the stage before it returned
        (the sum the next layer's fused add-norm would form: bit-equal to carrying both halves).
        """
        if hidden_states is None:
            hidden_states = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        residual = None
        for layer in self.stage_layers:
            hidden_states, residual = layer(rope, hidden_states, residual)
        if not self.stage.is_last:
            if residual is None:
                raise ValueError(f"pipeline stage {self.stage} holds no decoder layer")
            return hidden_states + residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Causal LM: LlamaModel + LM head (tied to the embedding when the config says so)."""

    # checkpoint projection name -> (our fused module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: PretrainedConfig, max_model_len: int | None = None, stage: PipelineStage | None = None
    ) -> None:
        super().__init__()
        max_model_len = max_model_len or config.max_position_embeddings
        window = sliding_window(config)
        if window is not None and max_model_len > window:
            # Within the window, sliding-window attention equals full attention, so we can skip it.
            raise ValueError(
                f"the model uses sliding-window attention (window {window}), which this engine does not "
                f"implement; set max_model_len <= {window} (got {max_model_len})"
            )
        self.config = config
        self.model = LlamaModel(config, max_position=max_model_len, stage=stage)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.model.stage.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of packed tokens (a stage's output: see LlamaModel.forward)."""
        return self.model(input_ids, positions, hidden_states)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """True for a checkpoint tensor that another pipeline stage holds (the loader skips it)."""
        stage = self.model.stage
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return index < stage.num_layers and not stage.start <= index < stage.end
        if name.startswith("model.embed_tokens."):
            return not hasattr(self.model, "embed_tokens")
        return name.startswith(("model.norm.", "lm_head.")) and not stage.is_last

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits (model dtype)."""
        return self.lm_head(hidden_states)
