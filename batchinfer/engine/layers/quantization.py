"""The weight formats an engine runs its linears in (EngineConfig.quantization), one class per format.

Each format says, in one place, what the engine's modules used to ask by comparing strings:
  - its loader: the file its packed weights come from besides the loaded model (`weight_source`), the
    format a speculative draft model runs in (`draft_quantization`), whether its weights split across
    tensor / pipeline parallel ranks (`splits_across_ranks`);
  - its packer: what it does to the loaded model to give every linear and the LM head a kernel (`pack`);
  - its kernel: what runs a linear (`kernel`, in words; `linear`, the per-matrix kernel for the linears
    it does not pack itself) and whether this torch / build can run it (`check_runnable`).

  none  dense weights: oneDNN's prepacked GEMM on CPU (fp32, bf16 with AVX-512), else F.linear
  int8  int8 weights per output channel, a dynamic int8 GEMM (fbgemm; oneDNN's on AMX), smoothing folded in
  gguf  a .gguf file's own Q4_0 / Q4_1 / Q8_0 blocks, our C++ kernels (csrc/gguf_linear.cpp)

Import-light (engine/config.py, the settings and the CLI read QUANTIZATIONS): torch and the layers are
imported inside a format's methods only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

LinearFn = Callable[["torch.Tensor"], "torch.Tensor"]


class QuantizationFormat:
    """A weight format: its methods are what the engine asks of it; the defaults are the dense format's."""

    name: str | None = None  # EngineConfig.quantization's value (None: dense)
    kernel = "oneDNN prepacked GEMM (fp32; bf16 with AVX-512), else F.linear"
    splits_across_ranks = True  # False: tensor_parallel_size and pipeline_parallel_size must be 1

    def weight_source(self, model: str) -> Path | None:
        """The file this format's packed weights are read from besides the loaded model (None: none)."""
        return None

    def draft_quantization(self, draft_model: str) -> str | None:
        """The quantization a speculative draft model runs in when the target runs this format."""
        return self.name

    def check_runnable(self) -> None:
        """A ValueError saying why when this torch / build cannot run the format (on CPU)."""

    def per_token_layers(self, model: nn.Module) -> set[nn.Module]:
        """The linears whose input is scaled per token before the GEMM (int8's down_proj)."""
        return set()

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *, per_token: bool) -> LinearFn | None:
        """The CPU kernel of one linear (x -> x @ W.T + bias), or None to keep F.linear."""
        from batchinfer.engine.layers.weight_packing import cpu_linear_kernel

        return cpu_linear_kernel(weight, bias)

    def pack_linears(self, model: nn.Module,
                     already_packed: set[nn.Module] | frozenset[nn.Module] = frozenset()) -> int:
        """Give every linear and the LM head this format's `linear` kernel; returns how many were packed."""
        from batchinfer.engine.layers.weight_packing import pack_linears

        return pack_linears(model, self, already_packed)

    def pack(self, model: nn.Module, *, model_path: str | Path | None, max_model_len: int | None,
             weight_source: Path | None) -> int:
        """Prepare the loaded model for this format and pack its linears; returns how many were packed."""
        return self.pack_linears(model)


class Dense(QuantizationFormat):
    """No quantization: the model's own dtype, on the panel GEMM or oneDNN's (cpu_linear_kernel)."""


class Int8(QuantizationFormat):
    """int8 weights per output channel through a dynamic int8 GEMM (layers/weight_packing.py)."""

    name = "int8"
    kernel = ("dynamic int8 GEMM (per-channel weights; fbgemm, oneDNN's on AMX CPUs), activation smoothing "
              "folded in at load")

    def check_runnable(self) -> None:
        """A ValueError when this torch build has no quantized engine for int8's GEMM."""
        import torch

        from batchinfer.engine.layers.weight_packing import int8_gemm_engine

        engine = int8_gemm_engine()  # raises naming the fix for an engine this build lacks
        if engine not in torch.backends.quantized.supported_engines:
            raise ValueError(f"quantization={self.name!r} needs torch's {engine} engine, absent from this "
                             "build")

    def per_token_layers(self, model: nn.Module) -> set[nn.Module]:
        """down_proj's input: its outliers sit on a few tokens (layers/int8_smoothing.py)."""
        from batchinfer.engine.layers.int8_smoothing import per_token_input_layers

        return per_token_input_layers(model)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *, per_token: bool) -> LinearFn | None:
        """The int8 kernel of one linear (int8_gemm_engine's)."""
        from batchinfer.engine.layers.weight_packing import int8_linear

        return int8_linear(weight, bias, per_token=per_token)

    def pack(self, model: nn.Module, *, model_path: str | Path | None, max_model_len: int | None,
             weight_source: Path | None) -> int:
        """Fold activation smoothing in (given the tokenizer's path and the length), then pack as int8."""
        if model_path is not None and max_model_len is not None:
            from batchinfer.engine.layers import int8_smoothing

            if int8_smoothing.smoothing_applies(model):
                calibration = int8_smoothing.calibration_token_ids(model_path, max_model_len)
                int8_smoothing.smooth_for_int8(model, calibration)
        return super().pack(model, model_path=model_path, max_model_len=max_model_len,
                            weight_source=weight_source)


class GGUFBlocks(QuantizationFormat):
    """A .gguf file's own Q4_0 / Q4_1 / Q8_0 blocks (layers/gguf_weights.py); its other tensors run dense."""

    name = "gguf"
    kernel = "q4_linear / q8_linear on the file's blocks (csrc/gguf_linear.cpp); other tensors dense"
    splits_across_ranks = False  # the blocks are whole matrices, never sharded

    def weight_source(self, model: str) -> Path | None:
        """The .gguf file `model` stands for; a ValueError naming the fix when it is none."""
        from batchinfer.engine.model_files import required_gguf_source

        return required_gguf_source(model)

    def draft_quantization(self, draft_model: str) -> str | None:
        """A GGUF draft runs its blocks too; another draft runs in the target's dtype."""
        from batchinfer.engine.model_files import gguf_source

        return self.name if gguf_source(draft_model) is not None else None

    def check_runnable(self) -> None:
        """A ValueError when the native CPU kernels are disabled or cannot be built."""
        from batchinfer.engine.layers.gguf_weights import gguf_kernel

        gguf_kernel()

    def pack(self, model: nn.Module, *, model_path: str | Path | None, max_model_len: int | None,
             weight_source: Path | None) -> int:
        """The block matrices on the file's blocks, the rest dense."""
        from batchinfer.engine.layers.gguf_weights import pack_gguf_blocks

        if weight_source is None:
            raise ValueError("quantization='gguf' runs a GGUF file's own 4-bit blocks: load a .gguf model")
        block_modules, _ = pack_gguf_blocks(model, weight_source)
        return self.pack_linears(model, already_packed=block_modules)


FORMATS: dict[str | None, QuantizationFormat] = {f.name: f for f in (Dense(), Int8(), GGUFBlocks())}
QUANTIZATIONS = tuple(name for name in FORMATS if name is not None)  # EngineConfig.quantization besides None


def quantization_format(quantization: str | None) -> QuantizationFormat:
    """The format named `quantization` (None: dense); a ValueError listing the valid names otherwise."""
    if not (quantization is None or isinstance(quantization, str)) or quantization not in FORMATS:
        raise ValueError(
            f"quantization: must be None or one of {', '.join(QUANTIZATIONS)}; got {quantization!r}"
        )
    return FORMATS[quantization]


def splitting_formats() -> str:
    """The formats whose weights split across ranks, as a fix to suggest: "quantization='int8' or none"."""
    names = [f"quantization={name!r}" for name in QUANTIZATIONS if FORMATS[name].splits_across_ranks]
    return " or ".join([*names, "none"])


def pack_weights(model: nn.Module, device: torch.device, quantization: str | None = None, *,
                 model_path: str | Path | None = None, max_model_len: int | None = None,
                 gguf_path: str | Path | None = None) -> int:
    """Give every linear layer and the LM head its CPU kernel (nothing on CUDA); returns how many.

    The format packs: int8 given model_path (whose tokenizer reads the calibration text) and max_model_len
    first folds activation smoothing into the weights when the whole model is on this rank
    (int8_smoothing), otherwise it is plain int8; gguf runs the Q4_0 / Q4_1 / Q8_0 tensors of gguf_path on
    their own blocks (gguf_weights) and the rest densely.
    """
    fmt = quantization_format(quantization)
    if fmt.name is not None and device.type != "cpu":
        raise ValueError(f"quantization={fmt.name!r} runs on CPU only; got device {device}")
    fmt.check_runnable()
    if device.type != "cpu":
        return 0
    return fmt.pack(model, model_path=model_path, max_model_len=max_model_len,
                    weight_source=None if gguf_path is None else Path(gguf_path))
