"""paged_attention (Triton) against paged_attention_ref, and the twin against dense SDPA."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchinfer.kernels.reference import paged_attention_ref, store_kvcache_ref

# Kernel vs its float32 twin, by activation dtype (the kernel feeds tl.dot in that dtype).
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass
class Batch:
    """One scheduler step: packed queries, a paged cache holding every sequence's K/V, and the metadata."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    dense_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], what the cache holds
    dense_v: list[torch.Tensor]

    def metadata(self) -> dict:
        return {"cu_seqlens_q": self.cu_seqlens_q, "seq_lens": self.seq_lens,
                "block_tables": self.block_tables}


def make_batch(
    q_lens: list[int],
    cached: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Batch:
    """Sequences with `cached[s]` tokens already in the cache and `q_lens[s]` new ones (whose K/V the step
    has just stored), on shuffled physical blocks; every slot no sequence owns holds NaN, so a kernel that
    reads past a sequence's keys poisons its output."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(cached, q_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 1  # one spare -1 column, as the model runner pads
    block_tables = torch.full((len(q_lens), max_blocks), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    dense_k, dense_v, slots = [], [], []
    used = 0
    for s, seq_len in enumerate(seq_lens):
        table = physical[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        block_tables[s, : len(table)] = table.to(torch.int32)
        pos = torch.arange(seq_len)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        dense_k.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
        dense_v.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
    store_kvcache_ref(torch.cat(dense_k), torch.cat(dense_v), k_cache, v_cache, torch.cat(slots))
    num_heads = num_kv_heads * group
    # q as a view into a fused qkv projection output: strided, like the model runner will pass it.
    qkv = torch.randn(sum(q_lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = dict(device=device)
    return Batch(
        q=qkv.to(**to)[:, :num_heads],
        k_cache=k_cache.to(**to),
        v_cache=v_cache.to(**to),
        cu_seqlens_q=cu.to(**to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(**to),
        dense_k=[k.to(**to) for k in dense_k],
        dense_v=[v.to(**to) for v in dense_v],
    )


def mixed_step(device: torch.device) -> tuple[list[int], list[int]]:
    """(q_lens, cached) of a step mixing decodes, fresh prefills, prefix-cache hits and mid-block chunks."""
    if device.type == "cpu":
        q_lens = [1, 21, 9, 12, 1, 5, 0]
        cached = [36, 0, 64, 5, 0, 70, 3]
    else:
        g = torch.Generator().manual_seed(1)
        q_lens = [1] * 40 + [517, 64, 300, 1000, 33]
        cached = torch.randint(1, 3000, (40,), generator=g).tolist() + [0, 512, 1024, 48, 2333]
    return q_lens, cached


# ---------------------------------------------------------------------------------------------- the twin


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_dense_sdpa(block_size: int, group: int, head_dim: int) -> None:
    b = make_batch([1, 21, 9, 12, 1, 4], [36, 0, 64, 5, 0, 90], block_size=block_size, num_kv_heads=2,
                   group=group, head_dim=head_dim)
    scale = head_dim**-0.5
    got = paged_attention_ref(b.q, b.k_cache, b.v_cache, **b.metadata(), scale=scale)
    assert not got.isnan().any()
    cu = b.cu_seqlens_q.tolist()
    for s, (k, v) in enumerate(zip(b.dense_k, b.dense_v, strict=True)):
        q = b.q[cu[s] : cu[s + 1]]
        q_len, seq_len = q.shape[0], k.shape[0]
        causal = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=causal, scale=scale,
        ).transpose(0, 1)
        torch.testing.assert_close(got[cu[s] : cu[s + 1]], want, atol=1e-5, rtol=1e-5)


def test_reference_writes_into_out() -> None:
    b = make_batch([3, 1], [0, 7], block_size=16, num_kv_heads=1, group=2, head_dim=64)
    out = torch.zeros(b.q.shape)
    got = paged_attention_ref(b.q, b.k_cache, b.v_cache, **b.metadata(), scale=0.125, out=out)
    assert got is out and out.abs().sum() > 0


# ------------------------------------------------------------------------------------------ the kernel


def _run_both(b: Batch, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    from batchinfer.kernels import paged_attention

    scale = b.q.shape[-1] ** -0.5
    got = paged_attention(b.q, b.k_cache, b.v_cache, **b.metadata(), scale=scale, **kwargs)
    want = paged_attention_ref(b.q, b.k_cache, b.v_cache, **b.metadata(), scale=scale)
    return got, want


# The interpreter is slow, so on CPU the shape grid below runs only these (block_size, group, head_dim,
# splits) cases, which still cover every pair of values; CUDA runs the whole grid.
INTERPRETER_CASES = {(16, 1, 64, 1), (16, 4, 128, "split"), (16, 8, 64, "split"), (32, 1, 128, "split"),
                     (32, 4, 64, 1), (32, 8, 128, 1), (16, 8, 128, 1), (32, 4, 128, "split")}


def _skip_on_interpreter(device, block_size, group, head_dim, num_splits) -> None:
    if device.type == "cpu" and (block_size, group, head_dim, 1 if num_splits == 1 else "split") not in (
            INTERPRETER_CASES):
        pytest.skip("interpreter: a pairwise-covering subset of the grid runs")


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_step_matches_reference(device, num_splits, block_size, group, head_dim) -> None:
    _skip_on_interpreter(device, block_size, group, head_dim, num_splits)
    q_lens, cached = mixed_step(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    b = make_batch(q_lens, cached, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim,
                   dtype=dtype, device=device)
    got, want = _run_both(b, num_splits=num_splits)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_step_matches_reference(device, num_splits, block_size, group, head_dim) -> None:
    _skip_on_interpreter(device, block_size, group, head_dim, num_splits)
    if device.type == "cpu":
        cached = [70, 1, 33, 300, 16]
    else:
        cached = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    b = make_batch([1] * len(cached), cached, block_size=block_size, num_kv_heads=2, group=group,
                   head_dim=head_dim, dtype=dtype, device=device)
    got, want = _run_both(b, num_splits=num_splits, max_seqlen_q=1)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize(("block_m", "block_n", "num_splits"), [(64, 64, 1), (128, 32, 2), (16, 16, 3)])
def test_explicit_launch_configs(device, block_m, block_n, num_splits) -> None:
    """The 16-bit prefill tiles (and the sweeps of bench/gpu_attention.py) on the interpreter's float32."""
    pa = importlib.import_module("batchinfer.kernels.paged_attention")
    q_lens, cached = mixed_step(device)
    b = make_batch(q_lens, cached, block_size=16, num_kv_heads=2, group=4, head_dim=128, device=device)
    scale = 128**-0.5
    out = torch.empty(b.q.shape, device=device)
    cfg = pa.LaunchConfig(block_m, block_n, num_splits, num_warps=4, num_stages=2)
    pa.launch(b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables, scale, out, cfg)
    want = paged_attention_ref(b.q, b.k_cache, b.v_cache, **b.metadata(), scale=scale)
    torch.testing.assert_close(out, want, **TOLERANCE[torch.float32])


def test_split_heuristic_launch(device) -> None:
    """num_splits=None: the heuristic picks (cpu: pretends 4 SMs, so a long decode batch splits)."""
    cached = [700, 1, 33, 300] if device.type == "cpu" else [3000, 17, 8000, 64]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    b = make_batch([1] * len(cached), cached, block_size=16, num_kv_heads=2, group=4, head_dim=128,
                   dtype=dtype, device=device)
    got, want = _run_both(b)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_on_cuda(device, dtype) -> None:
    if device.type == "cpu":
        pytest.skip("16-bit tiles are a GPU concern; the interpreter tests run float32")
    q_lens, cached = mixed_step(device)
    b = make_batch(q_lens, cached, block_size=16, num_kv_heads=8, group=4, head_dim=128, dtype=dtype,
                   device=device)
    got, want = _run_both(b)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_odd_head_dim_and_out_buffer(device) -> None:
    b = make_batch([1, 6, 1], [20, 9, 0], block_size=16, num_kv_heads=1, group=3, head_dim=80, device=device)
    out = torch.full(b.q.shape, float("nan"), device=device)
    got, want = _run_both(b, out=out, num_splits=2)
    assert got is out
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_rejects_bad_inputs(device) -> None:
    from batchinfer.kernels import paged_attention

    b = make_batch([2], [3], block_size=16, num_kv_heads=1, group=1, head_dim=64, device=device)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention(b.q, b.k_cache, b.v_cache, cu_seqlens_q=b.cu_seqlens_q, seq_lens=b.seq_lens,
                        block_tables=b.block_tables.float(), scale=1.0)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        paged_attention(b.q, b.k_cache, b.v_cache, cu_seqlens_q=b.cu_seqlens_q, seq_lens=b.seq_lens.float(),
                        block_tables=b.block_tables, scale=1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(b.q.half(), b.k_cache, b.v_cache, **b.metadata(), scale=1.0)


def test_cpu_tensors_without_interpreter_get_a_clear_error(monkeypatch) -> None:
    pytest.importorskip("triton")
    from batchinfer.kernels import _device, paged_attention

    monkeypatch.setattr(_device, "INTERPRETED", False)
    b = make_batch([2], [3], block_size=16, num_kv_heads=1, group=1, head_dim=64)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        paged_attention(b.q, b.k_cache, b.v_cache, **b.metadata(), scale=1.0)


def test_import_without_triton_keeps_the_twins() -> None:
    code = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ImportError("triton is not installed")
sys.meta_path.insert(0, NoTriton())
from batchinfer import kernels
assert not kernels.TRITON_AVAILABLE and callable(kernels.paged_attention_ref)
try:
    kernels.paged_attention(None, None, None)
except ImportError as exc:
    print(exc)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needs the `triton` package; use batchinfer.kernels.paged_attention_ref" in proc.stdout


# ------------------------------------------------------------------ compiling for the GPU, without one
#
# The interpreter runs kernels as numpy code, so it cannot see what only the GPU compiler rejects
# (loop-carried type changes, tl.dot shapes, shared-memory overflow). Triton compiles for Hopper (sm_90,
# the H200) with no GPU present, but only in a process that imported triton without the interpreter:
# hence a subprocess, which records the launches real calls make and compiles each one.

H200_MAX_SHARED_BYTES = 232448  # per-block opt-in limit of sm_90
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                 torch.int64: "i64"}


def _compile_for_hopper(kernel, args: tuple, kwargs: dict):
    """Compile one launch for sm_90, specialized as the JIT would (16-divisible pointers and ints marked)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    constexprs = {k: v for k, v in kwargs.items() if k not in options}
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(kernel.arg_names, args, strict=False)):
        if isinstance(value, torch.Tensor):
            signature[name], divisible = "*" + _TRITON_TYPES[value.dtype], value.data_ptr() % 16 == 0
        elif isinstance(value, int):
            signature[name], divisible = ("i32" if abs(value) < 2**31 else "i64"), value % 16 == 0
        else:
            signature[name], divisible = "fp32", False
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_all_for_hopper() -> list[dict]:
    """Run each kernel's public function on CPU tensors with launches recorded, then compile every launch."""
    from batchinfer.kernels import _device

    assert not _device.INTERPRETED, "run without TRITON_INTERPRET"
    modules = {name: importlib.import_module(f"batchinfer.kernels.{name}") for name in
               ("paged_attention", "store_kvcache", "rmsnorm")}
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    for module in modules.values():
        module.check_device = lambda *tensors: None
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            setattr(module, name, Recorder(getattr(module, name)))

    attention = modules["paged_attention"].paged_attention
    for dtype, group, head_dim, decode in [(torch.bfloat16, 4, 128, True), (torch.bfloat16, 8, 128, False),
                                           (torch.float32, 4, 128, False), (torch.float16, 3, 80, True)]:
        q_lens, cached = ([1] * 6, [700, 3, 40, 2000, 16, 64]) if decode else ([1, 300, 40], [900, 0, 512])
        b = make_batch(q_lens, cached, block_size=16, num_kv_heads=8, group=group, head_dim=head_dim,
                       dtype=dtype)
        attention(b.q, b.k_cache, b.v_cache, **b.metadata(), scale=0.1, num_splits=2 if decode else 1)
    cache = torch.zeros(64, 16, 8, 128, dtype=torch.bfloat16)
    kv = torch.zeros(10, 8, 128, dtype=torch.bfloat16)
    modules["store_kvcache"].store_kvcache(kv, kv, cache, cache, torch.arange(10))
    x = torch.zeros(4, 4096, dtype=torch.bfloat16)
    modules["rmsnorm"].rms_norm(x, x[0], 1e-6)
    modules["rmsnorm"].rms_norm(x, x[0], 1e-6, residual=x)
    return [{"kernel": kernel.fn.__name__,
             "shared": _compile_for_hopper(kernel, args, kwargs).metadata.shared}
            for kernel, args, kwargs in launches]


def test_kernels_compile_for_hopper() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from tests.kernels.test_paged_attention import compile_all_for_hopper as run; "
            "print(json.dumps(run()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [c["kernel"] for c in compiled] == (
        ["_paged_attention_kernel", "_merge_splits_kernel"] + ["_paged_attention_kernel"] * 2
        + ["_paged_attention_kernel", "_merge_splits_kernel", "_store_kvcache_kernel"]
        + ["_rms_norm_kernel"] * 2)
    for c in compiled:
        assert c["shared"] <= H200_MAX_SHARED_BYTES, c


# ------------------------------------------------------------------------------------ launch heuristic


def test_split_heuristic() -> None:
    pytest.importorskip("triton")
    from batchinfer.kernels.paged_attention import MIN_KEYS_PER_SPLIT, choose_config

    def splits(num_seqs: int, max_k: int, max_q: int = 1, tokens: int | None = None) -> int:
        config = choose_config(num_tokens=tokens or num_seqs, num_seqs=num_seqs, num_kv_heads=8, group=4,
                               head_dim=128, elem_bytes=2, max_seqlen_q=max_q, max_seqlen_k=max_k,
                               num_sms=132)
        return config.num_splits

    assert splits(1, 8192) == 16  # one long sequence: spread it over the GPU
    assert splits(64, 2048) == 2
    assert splits(256, 2048) == 1  # enough programs already
    assert splits(1, 300) == 1  # too short to be worth a merge
    assert splits(1, 4096) * MIN_KEYS_PER_SPLIT <= 4096
    assert splits(8, 8192, max_q=2048, tokens=2048 + 7) == 1  # a big prefill fills the GPU by itself
    cfg = choose_config(num_tokens=64, num_seqs=64, num_kv_heads=8, group=4, head_dim=128, elem_bytes=2,
                        max_seqlen_q=1, max_seqlen_k=4096, num_sms=132, num_splits=1)
    assert cfg.num_splits == 1 and cfg.block_m == 16
