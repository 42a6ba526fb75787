"""quantization="gguf" (engine/layers/gguf_weights.py, csrc/gguf_linear.cpp): the GGUF file's own blocks.

Block decoding on hand-made bytes, llama.cpp's Q/K row order undone, the Q4 / Q8 kernels against the
de-quantized matmul at every batch shape they branch on, and the real SmolLM2 GGUF: every linear on its
Q4_1 blocks, the tied embedding / LM head on its Q8_0 blocks, greedy output identical to fp32, and a layer
whose loaded weight disagrees with its blocks refused at load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers.gguf_weights import (
    BlockWeight,
    GGUFMismatchError,
    block_linear,
    block_lookup,
    decode_blocks,
    gguf_kernel,
    pack_gguf_blocks,
    unpermute_rows,
)
from batchinfer.engine.llm_engine import Engine
from batchinfer.engine.model_files import gguf_source
from batchinfer.engine.sampling_params import SamplingParams

SMOLLM2 = "smollm2-135m-instruct"


def q4_1_block(d: float, m: float, codes: list[int]) -> bytes:
    """One Q4_1 block as llama.cpp writes it: fp16 d, fp16 m, byte j = code j | code (j + 16) << 4."""
    packed = bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
    return np.float16(d).tobytes() + np.float16(m).tobytes() + packed


def test_q4_1_q4_0_and_q8_0_blocks_decode_to_the_files_values():
    codes_a, codes_b = list(range(16)) * 2, [15 - (j % 16) for j in range(32)]
    raw = np.frombuffer(q4_1_block(0.5, -2.0, codes_a) + q4_1_block(0.25, 1.0, codes_b), np.uint8)
    weight = decode_blocks(raw.reshape(1, -1), "Q4_1", 64)
    assert weight.kind == "q4" and weight.shape == (1, 64)
    assert weight.d.tolist() == [[0.5, 0.25]] and weight.m.tolist() == [[-2.0, 1.0]]
    expected = [0.5 * c - 2.0 for c in codes_a] + [0.25 * c + 1.0 for c in codes_b]
    assert weight.dequantize()[0].tolist() == expected
    q4_0 = np.frombuffer(np.float16(2.0).tobytes() + q4_1_block(0, 0, codes_a)[4:], np.uint8)
    weight = decode_blocks(q4_0.reshape(1, -1), "Q4_0", 32)
    assert weight.dequantize()[0].tolist() == [2.0 * (c - 8) for c in codes_a]  # w = d * (q - 8)
    signed = list(range(-16, 16))
    q8_0 = np.frombuffer(np.float16(0.125).tobytes() + np.array(signed, np.int8).tobytes(), np.uint8)
    weight = decode_blocks(np.stack([q8_0, q8_0]), "Q8_0", 32)
    assert weight.kind == "q8" and weight.m is None
    assert weight.dequantize().tolist() == [[0.125 * c for c in signed]] * 2


def random_blocks(kind: str, rows: int, columns: int) -> BlockWeight:
    groups = columns // 32
    d = torch.rand(rows, groups) * 0.05
    if kind == "q8":
        return BlockWeight("q8", torch.randint(-128, 128, (rows, columns), dtype=torch.int8), d, None)
    codes = torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8)
    return BlockWeight("q4", codes, d, torch.randn(rows, groups) * 0.1)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_rows_undoes_llama_cpps_rotary_permutation(n_head: int):
    rows = n_head * 8
    weight = torch.randn(rows, 4)
    # llama.cpp's convert_hf_to_gguf permute: reshape(n_head, 2, half), swap the last two, flatten
    stored = weight.reshape(n_head, 2, rows // n_head // 2, 4).swapaxes(1, 2).reshape(rows, 4)
    assert torch.equal(stored[unpermute_rows(rows, n_head)], weight)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("inference", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 64, 200])
def test_the_kernels_equal_the_dequantized_matmul(kind: str, rows: int, inference: bool):
    """Up to 8 rows take the register path, more the tiled GEMM; N is no multiple of the tile."""
    gguf_kernel()
    torch.manual_seed(rows)
    weight = random_blocks(kind, 300, 96)
    bias = torch.randn(300)
    linear = block_linear(weight, bias, torch.float32)
    x = torch.randn(rows, 96)
    with torch.inference_mode(inference):
        out = linear(x)
    expected = x @ weight.dequantize().t() + bias
    assert out.shape == (rows, 300)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    batched = linear(x.reshape(1, rows, 96))  # [batch, T, K] callers keep working
    torch.testing.assert_close(batched, expected.reshape(1, rows, 300), rtol=1e-5, atol=1e-4)


def test_the_embedding_lookup_dequantizes_the_rows_asked_for():
    weight = random_blocks("q8", 50, 64)
    ids = torch.tensor([[3, 0], [49, 3]])
    rows = block_lookup(weight, torch.float32)(ids)
    assert rows.shape == (2, 2, 64)
    assert torch.equal(rows, weight.dequantize()[ids])


def test_quantization_gguf_needs_a_gguf_model(tiny_llama):
    with pytest.raises(ValueError, match="not a .gguf file"):
        Engine(EngineConfig(model=str(tiny_llama), device="cpu", quantization="gguf"))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(model=SMOLLM2, device="cpu", quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization: must be None or one of int8, gguf"):
        EngineConfig(model=SMOLLM2, device="cpu", quantization="q4")


@pytest.fixture(scope="module")
def smollm2_pair(smollm2, single_thread):
    """SmolLM2 on its GGUF's Q4_1 blocks and in fp32 (both from the same file)."""
    engines = {q: Engine(EngineConfig(model=SMOLLM2, device="cpu", dtype="float32", quantization=q,
                                      adaptive_threads=False)) for q in ("gguf", None)}
    yield engines
    for engine in engines.values():
        engine.close()


def generate(engine: Engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    return [list(done[str(i)]) for i in range(len(prompts))]


def test_every_smollm2_matrix_runs_on_its_blocks(smollm2_pair):
    model = smollm2_pair["gguf"].model_runner.model
    layers = model.model.layers
    linears = [layer.get_submodule(name) for layer in layers
               for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    assert len(linears) == 4 * len(layers) == 120
    for module in linears:
        assert module.packed is not None and module.packed.__qualname__.startswith("block_linear")
        assert module.weight.numel() == 0  # the fp32 copy is released
    # the tied embedding / LM head is Q8_0 in this file: both on its blocks, the fp32 table released
    assert model.lm_head.packed.__qualname__.startswith("block_linear")
    assert model.model.embed_tokens.lookup is not None and model.model.embed_tokens.weight.numel() == 0


def test_greedy_output_equals_fp32(smollm2_pair):
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3,"]
    assert generate(smollm2_pair["gguf"], prompts, 24) == generate(smollm2_pair[None], prompts, 24)


def test_a_layer_that_disagrees_with_its_blocks_is_refused(smollm2, single_thread, monkeypatch):
    monkeypatch.setenv("BATCHINFER_CPU_LINEAR", "aten")  # keep the dense weights to compare with
    engine = Engine(EngineConfig(model=SMOLLM2, device="cpu", dtype="float32", adaptive_threads=False))
    try:
        model = engine.model_runner.model
        model.model.layers[3].mlp.down_proj.weight.data[0, 0] += 0.5
        with pytest.raises(GGUFMismatchError, match=r"blk\.3\.ffn_down"):
            pack_gguf_blocks(model, gguf_source(SMOLLM2))
    finally:
        engine.close()


def test_bf16_loads_on_the_same_blocks(smollm2, single_thread):
    """The loader rounded the weights to bf16: the check compares at bf16's precision, the kernels run."""
    engine = Engine(EngineConfig(model=SMOLLM2, device="cpu", dtype="bfloat16", quantization="gguf",
                                 adaptive_threads=False))
    try:
        assert engine.model_runner.model.model.layers[0].mlp.down_proj.weight.numel() == 0
        (tokens,) = generate(engine, ["The capital of France is"], 8)
        assert len(tokens) == 8
    finally:
        engine.close()


def test_a_draft_model_gets_the_block_format_only_when_it_is_a_gguf(tiny_llama):
    import json

    from batchinfer.engine.spec_decode.draft import DraftModelProposer
    from batchinfer.engine.speculative_config import SpeculativeConfig

    target = EngineConfig(model=SMOLLM2, device="cpu", dtype="float32", quantization="gguf")
    spec = SpeculativeConfig(method="draft_model", model=str(tiny_llama), num_speculative_tokens=2)
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    draft = DraftModelProposer(spec, target, num_kv_blocks=8, vocab_size=vocab, max_model_len=64)
    try:
        assert draft.runner.config.quantization is None  # a safetensors draft runs densely
    finally:
        draft.close()
