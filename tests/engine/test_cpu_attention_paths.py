"""The native decode attention kernel at every path this build has (generic, AVX2, AVX-512, avx512_bf16),
over fp32 / bf16 caches and int8 / u8 codes, against a float32 torch reference: GQA, odd lengths, block
boundaries, scattered blocks; and the quantized cache's native decode against its torch path (issue 34)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.attention_plan import build_torch_plan
from batchinfer.engine.layers.kv_quant import FORMATS, dequantize, quantize
from batchinfer.engine.layers.quantized_attention import QuantizedKV, quantized_paged_attention

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="native CPU kernel not built here")

BLOCK_SIZE = 16
SEQ_LENS = [1, 15, 16, 17, 33, 95]  # one row, a block minus/exactly/plus one, odd lengths
# (heads, kv heads, head_dim): G = 1 and G > 1 at D = 64 and 128 (G = 3, 5, 7, 8: the AVX2 path's value tiles
# of up to 4 heads and their remainders), and D = 16 (the portable loops only)
SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 64), (2, 2, 128), (10, 2, 128), (14, 2, 64), (16, 2, 64),
          (6, 2, 16)]


def _paths() -> list[str]:
    built = cpu_attention.set_isa("auto")
    order = list(cpu_attention.ISAS[1:])
    return order[: order.index(built) + 1]


@pytest.fixture(autouse=True)
def _restore_path() -> Iterator[None]:
    yield
    cpu_attention.set_isa("auto")


def _reference(q, k_cache, v_cache, tables, seq_lens, scale) -> torch.Tensor:
    """Float32 attention of each q[s] over its first seq_lens[s] cached rows, read through the block table."""
    num_heads, block_size, num_kv_heads = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for s in range(q.shape[0]):
        pos = torch.arange(int(seq_lens[s]))
        blocks = tables[s][pos // block_size].long()
        keys = k_cache[blocks, pos % block_size].float().repeat_interleave(num_heads // num_kv_heads, 1)
        values = v_cache[blocks, pos % block_size].float().repeat_interleave(num_heads // num_kv_heads, 1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[s].float(), keys) * scale, -1)
        out[s] = torch.einsum("hl,lhd->hd", probs, values)
    return out


def _case(heads: int, kv_heads: int, head_dim: int, seed: int, block_size: int = BLOCK_SIZE):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 48
    per_seq = -(-max(SEQ_LENS) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:per_seq] for _ in SEQ_LENS]).int()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 2
    q = torch.randn(len(SEQ_LENS), heads, head_dim, generator=gen)
    return q, k, v, tables, torch.tensor(SEQ_LENS, dtype=torch.int32)


def _quantized(k: torch.Tensor, v: torch.Tensor, name: str):
    """(k codes, v codes, k params, v params) of a [NB, BS, Hkv, D] cache in kv_quant's format `name`."""
    fmt = FORMATS[name]
    (kc, kp), (vc, vp) = quantize(k.flatten(0, 1), fmt), quantize(v.flatten(0, 1), fmt)
    assert kp is not None and vp is not None
    params_shape = (*k.shape[:3], fmt.num_params)
    return (kc.view(k.shape), vc.view(k.shape), kp.reshape(params_shape).contiguous(),
            vp.reshape(params_shape).contiguous())


@pytest.mark.parametrize("cache", ["fp32", "bf16", "int8", "u8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_path_matches_the_portable_loops(cache: str, shape: tuple[int, int, int]) -> None:
    """Each SIMD path (AVX2 for every cache type, AVX-512 where built) equals item_generic's output."""
    q, k, v, tables, lens = _case(*shape, seed=5)
    if cache == "bf16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = shape[2] ** -0.5

    def attend(path: str) -> torch.Tensor:
        cpu_attention.set_isa(path)
        out = torch.empty_like(q)
        if cache in ("fp32", "bf16"):
            return cpu_attention.paged_decode_attention(out, q, k, v, tables, lens, scale)
        return cpu_attention.paged_decode_attention_quantized(out, q, *_quantized(k, v, cache), tables, lens,
                                                              scale)

    expected = attend("generic")
    # the paths differ in summation order only; bf16: up to one rounding step of the output
    tol = {"fp32": 1e-5, "bf16": 8e-3, "int8": 2e-5, "u8": 2e-5}[cache]
    for path in _paths()[1:]:
        torch.testing.assert_close(attend(path).float(), expected.float(), atol=tol, rtol=tol,
                                   msg=lambda m, p=path: f"{p}: {m}")


@pytest.mark.parametrize("cache", ["fp32", "bf16", "int8", "u8"])
def test_a_block_size_that_is_not_a_multiple_of_eight(cache: str) -> None:
    """Blocks of 12 rows: the 8-key score groups end inside a block, and the tails run per key."""
    q, k, v, tables, lens = _case(9, 3, 64, seed=11, block_size=12)
    if cache == "bf16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = 64 ** -0.5
    if cache in ("int8", "u8"):
        codes = _quantized(k, v, cache)
        fmt = FORMATS[cache]
        k = dequantize(codes[0], codes[2], fmt, torch.float32)
        v = dequantize(codes[1], codes[3], fmt, torch.float32)
    expected = _reference(q, k, v, tables, lens, scale)
    for path in _paths():
        cpu_attention.set_isa(path)
        out = torch.empty_like(q)
        if cache in ("fp32", "bf16"):
            cpu_attention.paged_decode_attention(out, q, k, v, tables, lens, scale)
        else:
            cpu_attention.paged_decode_attention_quantized(out, q, *codes, tables, lens, scale)
        tol = 1e-2 if cache == "bf16" else 1e-4
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol,
                                   msg=lambda m, p=path: f"{p}: {m}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_matches_the_reference(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    q, k, v, tables, lens = _case(*shape, seed=shape[2])
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = shape[2] ** -0.5
    expected = _reference(q, k, v, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: the output's rounding
    for path in _paths():
        assert cpu_attention.set_isa(path) == path
        out = torch.empty_like(q)
        cpu_attention.paged_decode_attention(out, q, k, v, tables, lens, scale)
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol,
                                   msg=lambda m, p=path: f"{p}: {m}")


def test_a_strided_query_is_read_through_its_strides() -> None:
    q, k, v, tables, lens = _case(9, 3, 64, seed=3)
    wide = torch.randn(q.shape[0], q.shape[1] * 2, 64)[:, ::2]  # head stride 128
    wide.copy_(q)
    for path in _paths():
        cpu_attention.set_isa(path)
        out, ref = torch.empty_like(q), torch.empty_like(q)
        cpu_attention.paged_decode_attention(out, wide, k, v, tables, lens, 0.125)
        cpu_attention.paged_decode_attention(ref, q.contiguous(), k, v, tables, lens, 0.125)
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("name", ["int8", "u8"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_codes_match_the_dequantized_reference(name: str, shape: tuple[int, int, int],
                                                         dtype: torch.dtype) -> None:
    q, k, v, tables, lens = _case(*shape, seed=7)
    fmt = FORMATS[name]
    k_codes, v_codes, k_params, v_params = _quantized(k, v, name)
    k_values = dequantize(k_codes, k_params, fmt, torch.float32)
    v_values = dequantize(v_codes, v_params, fmt, torch.float32)
    q = q.to(dtype)
    scale = shape[2] ** -0.5
    expected = _reference(q, k_values, v_values, tables, lens, scale)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    for path in _paths():
        cpu_attention.set_isa(path)
        out = torch.empty_like(q)
        cpu_attention.paged_decode_attention_quantized(out, q, k_codes, v_codes, k_params, v_params, tables,
                                                       lens, scale)
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol,
                                   msg=lambda m, p=path: f"{p}: {m}")


@pytest.mark.parametrize("name", ["int8", "u8"])
def test_quantized_decode_groups_equal_the_torch_path(name: str) -> None:
    """A mixed step (prefills + decodes) over a quantized cache: native decode groups == gather + SDPA."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, num_blocks = 9, 3, 64, 40
    fmt = FORMATS[name]
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)

    def fresh() -> QuantizedKV:
        codes = torch.zeros(shape, dtype=fmt.storage)
        params = torch.zeros(*shape[:3], fmt.num_params)
        return QuantizedKV(fmt, codes, codes.clone(), params, params.clone())

    seq_lens, q_lens = [40, 17, 1, 66, 5], [40, 1, 1, 1, 5]  # prefills and decodes
    tables = [list(range(i * 8, i * 8 + 5)) for i in range(len(seq_lens))]
    slots = [tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for s, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)) for p in range(n - ql, n)]
    plans = {native: build_torch_plan(q_lens=q_lens, seq_lens=seq_lens, block_tables=tables,
                                      slot_mapping=torch.tensor(slots), block_size=BLOCK_SIZE,
                                      dtype=torch.float32, device=torch.device("cpu"), native_decode=native)
             for native in (True, False)}
    assert any(g.q_len == 1 for g in plans[False].groups) and plans[True].native_decode is not None
    history = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    tokens = len(slots)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    outs = []
    for native in (True, False):
        cache = fresh()
        codes, params = quantize(history, fmt)  # earlier tokens, already in the cache
        cache.k_codes.view(-1, kv_heads, head_dim).copy_(codes)
        cache.v_codes.view(-1, kv_heads, head_dim).copy_(codes)
        assert params is not None and cache.k_params is not None and cache.v_params is not None
        cache.k_params.view(-1, kv_heads, fmt.num_params).copy_(params)
        cache.v_params.view(-1, kv_heads, fmt.num_params).copy_(params)
        outs.append(quantized_paged_attention(q, k, v, cache, plans[native], head_dim**-0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("lens", [[95, 80, 64, 40, 17, 9, 3, 1], [1], [95, 1]])
def test_the_work_split_by_cost_computes_every_item_once(threads: int, lens: list[int]) -> None:
    """Lengths falling in batch order (a running batch in admission order), a batch with fewer (sequence,
    kv head) items than threads: each thread count gives the one-thread output, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, num_blocks = 4, 2, 64, 64
    per_seq = -(-max(lens) // BLOCK_SIZE)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:per_seq] for _ in lens]).int()
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    before = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            out = torch.full_like(q, float("nan"))  # an item left out stays NaN
            cpu_attention.paged_decode_attention(out, q, k, v, tables, seq_lens, head_dim ** -0.5)
            outputs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[1], _reference(q, k, v, tables, seq_lens, head_dim ** -0.5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("lens", "kv_heads", "parts", "bounds"), [
    ([599, 600], 1, 2, [0, 1, 2]),  # one sequence each, not both on one thread
    ([500, 510], 3, 2, [0, 3, 6]),  # cut at the nearer side of the item holding the half
    ([600, 400, 200, 50], 1, 2, [0, 1, 4]),  # the longest first (admission order): 616 against 698
    ([7], 2, 5, [0, 1, 2]),  # fewer items than threads: no empty runs
    ([], 3, 2, [0]),
])
def test_the_decode_work_is_cut_by_cost(lens: list[int], kv_heads: int, parts: int,
                                        bounds: list[int]) -> None:
    """Runs of near-equal cost (length + 16 per item), each cut at the item boundary nearest its share."""
    extension = cpu_attention.load()
    assert extension.decode_attention_runs(torch.tensor(lens, dtype=torch.int32), kv_heads, parts) == bounds
