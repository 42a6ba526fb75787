"""ModelRunner: KV cache sizing, dtype, the execute_model contract, the torch attention plan, and the
Triton backend (run through Triton's CPU interpreter in a subprocess) agreeing with the torch backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers.attention_plan import GROUP_WASTE_FACTOR, GROUP_WASTE_SLACK, build_torch_plan
from batchinfer.engine.worker.model_runner import ModelRunner

REPO = Path(__file__).resolve().parents[2]


class Seq:
    """The three Sequence fields the runner reads."""

    def __init__(self, token_ids: list[int], block_table: list[int], num_computed_tokens: int = 0) -> None:
        self.token_ids = token_ids
        self.block_table = block_table
        self.num_computed_tokens = num_computed_tokens


@pytest.fixture(scope="module")
def runner(tiny_llama: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64, device="cpu"))


def test_cpu_defaults_and_kv_budget(tiny_llama: Path) -> None:
    budget = 3 * 2**20
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32",
                                      kv_cache_memory_bytes=budget))
    cfg = runner.hf_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head_dim * 4
    assert runner.dtype == torch.float32 and runner.device == torch.device("cpu")
    assert runner.block_bytes == block_bytes and runner.num_kv_blocks == budget // block_bytes
    assert runner.max_model_len == cfg.max_position_embeddings
    attn = runner.attention_layers[0]
    assert attn.k_cache.shape == (runner.num_kv_blocks, 16, cfg.num_key_value_heads, head_dim)
    assert attn.k_cache.dtype == torch.float32 and not bool(attn.k_cache.any())
    assert all(p.dtype == torch.float32 for p in runner.model.parameters())
    assert not torch.cuda.is_initialized()  # the CPU path never touches CUDA


def test_explicit_block_count_and_too_small_budget(tiny_llama: Path) -> None:
    assert ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", num_kv_blocks=7)).num_kv_blocks == 7
    with pytest.raises(ValueError, match="holds no block.*kv_cache_memory_bytes"):
        ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", kv_cache_memory_bytes=1000))


def test_execute_model_contract(runner: ModelRunner) -> None:
    vocab = runner.hf_config.vocab_size
    a, b = Seq([3, 4, 5, 6, 7], [9, 2]), Seq([8, 9], [5])
    logits = runner.execute_model([(a, 5), (b, 1)])
    assert logits.shape == (2, vocab) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 0  # the engine advances them, not us
    assert runner.execute_model([]).shape == (0, vocab)


def test_bad_schedules_are_clear_errors(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="block_table holds 1 blocks"):
        runner.execute_model([(Seq(list(range(3, 12)), [0]), 9)])
    with pytest.raises(ValueError, match="need 1 <= n"):
        runner.execute_model([(Seq([3, 4], [0]), 3)])
    with pytest.raises(ValueError, match="need 1 <= n"):
        runner.execute_model([(Seq([3, 4], [0]), 0)])


def test_last_token_logits_do_not_depend_on_batch_company(runner: ModelRunner) -> None:
    """A sequence's logits are the same alone and batched with others (masks keep sequences apart)."""
    alone = runner.execute_model([(Seq([5, 6, 7, 8, 9, 10], [1, 2]), 6)])
    mixed = runner.execute_model(
        [(Seq([11, 12, 13], [3]), 3), (Seq([5, 6, 7, 8, 9, 10], [4, 5]), 6),
         (Seq([7] * 13, [6, 7, 8, 9]), 13)]
    )
    torch.testing.assert_close(mixed[1], alone[0], atol=1e-5, rtol=0)


def test_torch_plan_covers_each_query_once_with_bounded_padding() -> None:
    q_lens = [1] * 20 + [5, 17, 1, 3]
    seq_lens = [3 + 7 * i for i in range(20)] + [5, 40, 90, 12]
    block_size = 4
    tables = [list(range(100 * s, 100 * s + -(-n // block_size))) for s, n in enumerate(seq_lens)]
    slots = torch.arange(sum(q_lens))
    plan = build_torch_plan(q_lens=q_lens, seq_lens=seq_lens, block_tables=tables, slot_mapping=slots,
                            block_size=block_size, dtype=torch.float32, device=torch.device("cpu"))
    assert plan.store_rows is None and torch.equal(plan.store_slots, slots)
    covered = torch.cat([g.out_index for g in plan.groups]).sort().values
    assert torch.equal(covered, torch.arange(sum(q_lens)))
    assert len(plan.groups) > 1  # lengths 3..136 do not fit one padded batch
    starts = [sum(q_lens[:s]) for s in range(len(q_lens))]
    for g in plan.groups:
        members = [s for s in range(len(q_lens)) if starts[s] in g.out_index.tolist()]
        assert len(members) == g.num_seqs
        actual = sum(q_lens[s] * -(-seq_lens[s] // block_size) for s in members)
        padded = g.num_seqs * g.q_len * g.num_blocks
        assert padded <= GROUP_WASTE_FACTOR * actual or padded - actual <= GROUP_WASTE_SLACK
        assert g.mask.shape == (g.num_seqs, 1, g.q_len, g.num_blocks * block_size)


def test_native_decode_batch_takes_the_decode_tokens_of_a_mixed_step() -> None:
    plan = build_torch_plan(q_lens=[3, 1, 1], seq_lens=[3, 9, 17],
                            block_tables=[[4], [7, 2, 5], [1, 3, 6, 8, 9]],
                            slot_mapping=torch.tensor([16, 17, 18, 20, 35]), block_size=4,
                            dtype=torch.float32, device=torch.device("cpu"), native_decode=True)
    native = plan.native_decode
    assert native.token_index.tolist() == [3, 4] and native.seq_lens.tolist() == [9, 17]
    assert native.block_tables.tolist() == [[7, 2, 5, 0, 0], [1, 3, 6, 8, 9]]
    assert [g.out_index.tolist() for g in plan.groups] == [[0, 1, 2]]
    decode_only = build_torch_plan(q_lens=[1, 1], seq_lens=[9, 17], block_tables=[[7, 2, 5], [1, 3, 6, 8, 9]],
                                   slot_mapping=torch.tensor([20, 35]), block_size=4, dtype=torch.float32,
                                   device=torch.device("cpu"), native_decode=True)
    assert decode_only.native_decode.token_index is None and decode_only.groups == []


def test_skipped_slots_are_not_written() -> None:
    plan = build_torch_plan(q_lens=[3], seq_lens=[3], block_tables=[[0]],
                            slot_mapping=torch.tensor([0, -1, 2]), block_size=4, dtype=torch.float32,
                            device=torch.device("cpu"))
    assert plan.store_rows.tolist() == [0, 2] and plan.store_slots.tolist() == [0, 2]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16"])
def test_bfloat16_on_cpu_runs_close_to_float32(tiny_llama: Path, kv_cache_dtype: str) -> None:
    """bf16 weights over the default cache (u8 codes) and a plain bf16 one."""
    bf16 = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", dtype="bfloat16", num_kv_blocks=8,
                                    kv_cache_dtype=kv_cache_dtype))
    fp32 = ModelRunner(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=8))
    want = torch.uint8 if kv_cache_dtype == "auto" else torch.bfloat16  # resolved from the config alone
    assert bf16.attention_layers[0].k_cache.dtype == want
    tokens = [5, 9, 33, 2, 17, 40, 41, 42]
    low, high = (r.execute_model([(Seq(tokens, [3, 1]), 8)])[0] for r in (bf16, fp32))
    assert low.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(low, high, dim=0) > 0.99


TRITON_SCRIPT = textwrap.dedent(
    """
    import random, sys, torch
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.worker.model_runner import ModelRunner

    class Seq:
        def __init__(self, tokens, table):
            self.token_ids, self.block_table, self.num_computed_tokens = tokens, table, 0

    runners = [ModelRunner(EngineConfig(model=sys.argv[1], block_size=4, num_kv_blocks=48, device="cpu",
                                        dtype="float32", attention_backend=b)) for b in ("torch", "triton")]
    assert runners[1].attention_backend == "triton"
    rng = random.Random(0)
    worst = 0.0
    results = []
    for runner in runners:
        blocks = list(range(48))
        random.Random(1).shuffle(blocks)
        seqs = [Seq([rng.randrange(3, 300) for _ in range(n + 3)], [blocks.pop() for _ in range(5)])
                for n in (1, 6, 13)]
        rng = random.Random(0)
        steps = [runner.execute_model([(s, len(s.token_ids) - 3) for s in seqs])]
        for s in seqs:
            s.num_computed_tokens = len(s.token_ids) - 3
        for _ in range(3):  # decode steps over the cached prefill
            steps.append(runner.execute_model([(s, 1) for s in seqs]))
            for s in seqs:
                s.num_computed_tokens += 1
        results.append(torch.cat(steps))
    print("MAXDIFF", float((results[0] - results[1]).abs().max()))
    """
)


def test_triton_backend_matches_torch_backend(tiny_llama: Path) -> None:
    """The CUDA code path (store_kvcache + paged_attention kernels), run by Triton's CPU interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernels compile; this CPU interpreter check is for CPU-only hosts")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(tiny_llama)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    max_diff = float(done.stdout.split("MAXDIFF")[-1])
    assert max_diff < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_and_eager_match_the_cpu_path(tiny_llama: Path) -> None:
    """On CUDA: KV cache sized by profiling, decode steps replayed from CUDA graphs equal eager and CPU."""
    common = {"model": str(tiny_llama), "block_size": 4, "dtype": "float32", "max_num_seqs": 8}
    graphs = ModelRunner(EngineConfig(device="cuda", gpu_memory_utilization=0.5, **common))
    assert graphs.num_kv_blocks > 64 and graphs.attention_backend == "triton" \
        and graphs.decode_graphs.graphs
    eager = ModelRunner(EngineConfig(device="cuda", num_kv_blocks=64, enforce_eager=True, **common))
    cpu = ModelRunner(EngineConfig(device="cpu", num_kv_blocks=64, **common))
    results = []
    for runner in (graphs, eager, cpu):
        seqs = [Seq(list(range(3, 3 + n + 4)), list(range(8 * i, 8 * i + 8)))
                for i, n in enumerate((1, 5, 9))]
        steps = [runner.execute_model([(s, len(s.token_ids) - 4) for s in seqs]).cpu()]
        for s in seqs:
            s.num_computed_tokens = len(s.token_ids) - 4
        for _ in range(4):
            steps.append(runner.execute_model([(s, 1) for s in seqs]).cpu())
            for s in seqs:
                s.num_computed_tokens += 1
        results.append(torch.cat(steps))
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(results[1], results[2], atol=1e-3, rtol=0)  # TF32 matmuls on GPU may differ
