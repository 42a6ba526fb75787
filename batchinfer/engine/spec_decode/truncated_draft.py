"""Make a draft model from the target itself: its first N decoder layers, the same embedding, final norm
and head (a "layer-skip" draft). It shares the tokenizer by construction and needs no training, which is
what a model family without a smaller sibling (SmolLM2-135M here) leaves. On SmolLM2 it is a poor draft
(bench/speculative.py measures 1-4% acceptance with 4-16 of 30 layers); on the tiny test models it gives
the partial acceptance the tests need.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def write_truncated_draft(target_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """Save the first `num_layers` layers of the HF model in `target_dir` as a model in `out_dir`."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target_dir / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers: must be in [1, {total}]; got {num_layers}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(target_dir.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            match = _LAYER_KEY.match(name)
            if match is None or int(match.group(1)) < num_layers:
                tensors[name] = tensor.contiguous()
    # Tied embeddings share storage with the head: save_file refuses shared tensors, so clone them.
    save_file({name: tensor.clone() for name, tensor in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Qwen2): keep the first N
        config["layer_types"] = config["layer_types"][:num_layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in target_dir.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".index.json")) \
                and path.name != "config.json":
            shutil.copy2(path, out_dir / path.name)
    return out_dir
