"""Our paged-attention Llama-family models against transformers' logits (CPU, fp32).

Every case runs through ModelRunner.execute_model with scattered (non-contiguous) block tables, and
checks the logits of each scheduled entry's last token against transformers run on the full sequence.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.worker.model_runner import ModelRunner

ATOL = 1e-4


class FakeSeq:
    """The three Sequence fields the runner reads, with blocks handed out by a ScatteredBlocks pool."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = list(token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []


class ScatteredBlocks:
    """Hands out physical blocks in a shuffled order, so block tables are never contiguous."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size = block_size

    def ensure(self, seq: FakeSeq, num_tokens: int) -> None:
        """Give seq enough blocks for its first num_tokens positions."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self.free.pop())


def run_step(
    runner: ModelRunner, pool: ScatteredBlocks, scheduled: list[tuple[FakeSeq, int]]
) -> torch.Tensor:
    """Allocate, execute and advance num_computed_tokens like the engine does."""
    for seq, n in scheduled:
        pool.ensure(seq, seq.num_computed_tokens + n)
    logits = runner.execute_model(scheduled)
    for seq, n in scheduled:
        seq.num_computed_tokens += n
    return logits


def prefill_and_decode_logits(runner: ModelRunner) -> torch.Tensor:
    """Logits of a two-sequence prefill and two decode steps over scattered blocks, float32, stacked."""
    pool = ScatteredBlocks(256, 4)
    seqs = [FakeSeq([5, 9, 2, 7, 11, 3]), FakeSeq([8, 1, 4])]
    steps = [run_step(runner, pool, [(seq, len(seq.token_ids)) for seq in seqs])]
    for token in (6, 10):
        for seq in seqs:
            seq.token_ids.append(token)
        steps.append(run_step(runner, pool, [(seq, 1) for seq in seqs]))
    return torch.cat(steps).float()


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [len, vocab] of every position."""
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def make_runner(path: Path, *, block_size: int = 4, num_blocks: int = 256, **kwargs) -> ModelRunner:
    config = EngineConfig(model=str(path), block_size=block_size, num_kv_blocks=num_blocks, device="cpu",
                          dtype=kwargs.pop("dtype", "float32"),
                          **kwargs)
    return ModelRunner(config)


def random_tokens(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(
    scope="module",
    params=[("tiny_llama", "native"), ("tiny_llama", "sdpa"),
            ("tiny_qwen2", "native"), ("tiny_qwen2", "sdpa")],
    ids="-".join,
)
def model_pair(request):
    """(our runner, transformers model) for each tiny fixture model and CPU decode attention path."""
    name, decode_path = request.param
    path = request.getfixturevalue(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = make_runner(path)
    if decode_path == "native":
        if not runner.native_decode:
            pytest.skip("the native CPU decode kernel could not be built here (no g++/ninja?)")
    else:
        runner.native_decode = False  # decode tokens through the padded SDPA groups instead
    return runner, hf


def test_batched_full_prefill(model_pair) -> None:
    runner, hf = model_pair
    vocab = runner.hf_config.vocab_size
    pool = ScatteredBlocks(runner.num_kv_blocks, runner.block_size)
    prompts = [random_tokens(vocab, n, seed) for seed, n in enumerate([1, 7, 16, 23])]
    seqs = [FakeSeq(p) for p in prompts]
    logits = run_step(runner, pool, [(s, len(s.token_ids)) for s in seqs])
    assert logits.shape == (4, vocab) and logits.dtype == torch.float32
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_mixed_with_decode(model_pair) -> None:
    """A prompt prefilled in chunks over its cached blocks, in the steps of another sequence's decodes."""
    runner, hf = model_pair
    vocab = runner.hf_config.vocab_size
    pool = ScatteredBlocks(runner.num_kv_blocks, runner.block_size, seed=1)
    long_prompt = random_tokens(vocab, 30, seed=10)
    other = random_tokens(vocab, 9, seed=11) + random_tokens(vocab, 4, seed=12)  # 9 prompt + 4 "generated"
    chunked, decoding = FakeSeq(long_prompt), FakeSeq(other)
    ref_long, ref_other = hf_logits(hf, long_prompt), hf_logits(hf, other)
    first = run_step(runner, pool, [(decoding, 9), (chunked, 5)])
    torch.testing.assert_close(first[0], ref_other[8], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[1], ref_long[4], atol=ATOL, rtol=0)
    done = 5
    for chunk in (3, 8, 1, 13):
        logits = run_step(runner, pool, [(chunked, chunk), (decoding, 1)])
        done += chunk
        torch.testing.assert_close(logits[0], ref_long[done - 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], ref_other[decoding.num_computed_tokens - 1], atol=ATOL, rtol=0)
    assert done == len(long_prompt)


def test_batched_decode_steps(model_pair) -> None:
    """Many sequences of different lengths decoding together (teacher-forced), block tables scattered."""
    runner, hf = model_pair
    vocab = runner.hf_config.vocab_size
    pool = ScatteredBlocks(runner.num_kv_blocks, runner.block_size, seed=2)
    lengths = [3, 4, 5, 9, 17, 33, 6, 12]
    steps = 6
    full = [random_tokens(vocab, n + steps, seed=100 + i) for i, n in enumerate(lengths)]
    seqs = [FakeSeq(t) for t in full]
    run_step(runner, pool, [(s, n) for s, n in zip(seqs, lengths, strict=True)])
    refs = [hf_logits(hf, t) for t in full]
    for _ in range(steps):
        logits = run_step(runner, pool, [(s, 1) for s in seqs])
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], refs[i][s.num_computed_tokens - 1], atol=ATOL, rtol=0)


def test_prefix_reuse_across_sequences(model_pair) -> None:
    """Two sequences sharing cached prefix blocks (as the prefix cache hands out) attend to the same K/V."""
    runner, hf = model_pair
    vocab = runner.hf_config.vocab_size
    bs = runner.block_size
    pool = ScatteredBlocks(runner.num_kv_blocks, bs, seed=3)
    prefix = random_tokens(vocab, 3 * bs, seed=20)
    first = FakeSeq(prefix + random_tokens(vocab, 5, seed=21))
    run_step(runner, pool, [(first, len(first.token_ids))])
    second = FakeSeq(prefix + random_tokens(vocab, 6, seed=22))
    second.block_table = first.block_table[:3]  # the full prefix blocks, already computed
    second.num_computed_tokens = 3 * bs
    logits = run_step(runner, pool, [(second, 6)])
    torch.testing.assert_close(logits[0], hf_logits(hf, second.token_ids)[-1], atol=ATOL, rtol=0)


def _save_tiny(config, directory: Path, cls=None) -> Path:
    torch.manual_seed(0)
    model = (cls or LlamaForCausalLM)(config).to(torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


TINY = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "initializer_range": 0.2,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rope_scaling_configs(tmp_path: Path, rope: dict) -> None:
    """Scaled rope variants match transformers, including positions past the original context."""
    config = LlamaConfig(**TINY, rope_scaling=dict(rope), tie_word_embeddings=True)
    assert config.rope_parameters["rope_type"] == rope["rope_type"]
    path = _save_tiny(config, tmp_path / "model")
    (path / "config.json").read_text()  # saved in the installed transformers' own format
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = make_runner(path, block_size=8)
    pool = ScatteredBlocks(runner.num_kv_blocks, 8, seed=4)
    tokens = random_tokens(97, 150, seed=5)
    seq = FakeSeq(tokens)
    ref = hf_logits(hf, tokens)
    logits = run_step(runner, pool, [(seq, 120)])
    torch.testing.assert_close(logits[0], ref[119], atol=ATOL, rtol=0)
    for _ in range(30):
        logits = run_step(runner, pool, [(seq, 1)])
        torch.testing.assert_close(logits[0], ref[seq.num_computed_tokens - 1], atol=ATOL, rtol=0)


def test_legacy_rope_scaling_dict_is_read() -> None:
    """Configs written by older transformers keep rope settings in rope_scaling + rope_theta."""
    from types import SimpleNamespace

    from batchinfer.engine.layers.rotary import rope_settings

    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_settings(legacy) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    assert rope_settings(SimpleNamespace(rope_theta=1e4)) == {"rope_type": "default", "rope_theta": 1e4}


def test_unsupported_rope_type_is_a_clear_error(tmp_path: Path) -> None:
    config = LlamaConfig(**TINY, rope_scaling={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    path = _save_tiny(config, tmp_path / "model")
    with pytest.raises(ValueError, match="rope_type 'dynamic'.*not supported"):
        make_runner(path)


def test_mistral_and_sliding_window(tmp_path: Path) -> None:
    """Mistral runs as a Llama; a sliding window shorter than max_model_len is refused with the fix."""
    from transformers import MistralForCausalLM

    config = MistralConfig(**TINY, sliding_window=None, head_dim=16)
    path = _save_tiny(config, tmp_path / "mistral", MistralForCausalLM)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = make_runner(path)
    tokens = random_tokens(97, 40, seed=6)
    logits = run_step(runner, ScatteredBlocks(runner.num_kv_blocks, 4), [(FakeSeq(tokens), 40)])
    torch.testing.assert_close(logits[0], hf_logits(hf, tokens)[-1], atol=ATOL, rtol=0)

    windowed = MistralConfig(**TINY, sliding_window=64)
    path = _save_tiny(windowed, tmp_path / "windowed", MistralForCausalLM)
    with pytest.raises(ValueError, match="max_model_len <= 64"):
        make_runner(path)
    assert make_runner(path, max_model_len=64).max_model_len == 64


def test_qwen2_config_from_scratch_has_bias(tmp_path: Path) -> None:
    """Qwen2 q/k/v biases are loaded (a nonzero bias changes the logits, so a dropped bias would fail)."""
    from transformers import Qwen2ForCausalLM

    config = Qwen2Config(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0, 1.0)
            layer.self_attn.q_proj.bias.normal_(0, 1.0)
    model.save_pretrained(tmp_path / "qwen", safe_serialization=True)
    runner = make_runner(tmp_path / "qwen")
    tokens = random_tokens(97, 21, seed=7)
    logits = run_step(runner, ScatteredBlocks(runner.num_kv_blocks, 4), [(FakeSeq(tokens), 21)])
    torch.testing.assert_close(logits[0], hf_logits(model, tokens)[-1], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_smollm2_alias_loads_and_matches_transformers(smollm2: Path) -> None:
    """The real SmolLM2-135M (alias -> converted GGUF): prefill and decode logits match transformers."""
    from batchinfer.engine.models.loader import load_tokenizer

    runner = make_runner("smollm2-135m-instruct", block_size=16, num_blocks=16)
    assert runner.model_path == smollm2 and runner.hf_config.tie_word_embeddings
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(smollm2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    tokens = prompt + tokenizer(" The capital of France is Paris.", add_special_tokens=False).input_ids
    ref = hf_logits(hf, tokens)
    seq = FakeSeq(tokens)
    pool = ScatteredBlocks(runner.num_kv_blocks, 16, seed=8)
    logits = run_step(runner, pool, [(seq, len(prompt))])
    torch.testing.assert_close(logits[0], ref[len(prompt) - 1], atol=2e-4, rtol=0)
    while seq.num_computed_tokens < len(tokens):
        logits = run_step(runner, pool, [(seq, 1)])
        torch.testing.assert_close(logits[0], ref[seq.num_computed_tokens - 1], atol=2e-4, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_vectorized_decode_head_dims(tmp_path: Path, head_dim: int) -> None:
    """head_dim 64/128 take the AVX2 branch of the native CPU decode kernel (the tiny fixtures use 16)."""
    # A wider model than TINY: a smaller init keeps activations (and fp32 rounding) at the fixtures' scale.
    wide = {**TINY, "hidden_size": 2 * head_dim, "num_attention_heads": 2, "initializer_range": 0.1}
    config = LlamaConfig(**wide, head_dim=head_dim)
    path = _save_tiny(config, tmp_path / "model")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = make_runner(path)
    pool = ScatteredBlocks(runner.num_kv_blocks, 4, seed=9)
    full = [random_tokens(97, n + 5, seed=30 + n) for n in (2, 11, 26)]
    seqs = [FakeSeq(t) for t in full]
    run_step(runner, pool, [(s, len(s.token_ids) - 5) for s in seqs])
    refs = [hf_logits(hf, t) for t in full]
    assert runner.native_decode or pytest.skip("native CPU decode kernel not built here")
    for _ in range(5):
        logits = run_step(runner, pool, [(s, 1) for s in seqs])
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], refs[i][s.num_computed_tokens - 1], atol=ATOL, rtol=0)
