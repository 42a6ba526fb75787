"""Embeddings, held out (issue 34): `batchinfer run` on an embeddings job vs the transformers loop of users.

    flock /tmp/bench.lock .venv/bin/python bench/embeddings.py

480 texts of 12-180 words, drawn from a fixed seed over a word list (texts the engine was never tuned on),
go in 24 JSONL lines of 20 inputs each (OpenAI batch lines, url /v1/embeddings) through `batchinfer run` as
a whole process (model load included) on SmolLM2-135M-Instruct in float32. The baseline is also a whole
process: transformers in float32, texts sorted by length, padded batches of 32, the final hidden state
mean-pooled over the attention mask and L2-normalised. Printed: wall and CPU seconds (the child process's
user + system) of each, the speed ratio (target: ours >= 1.5x) and the minimum cosine between the two
sets of vectors (target: >= 0.999), after the CPU kind.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nightly import cpu_kind, timed_child  # noqa: E402  # bench/ is not a package

ROOT = Path(__file__).resolve().parents[1]
WORDS = (  # noqa: SIM905  # a word list reads best as text
    "river stone lantern orchard copper meadow harbor thimble quarry falcon velvet cedar prism glacier "
    "mosaic tundra saddle ember ledger willow cobalt fjord almanac biscuit canyon dahlia estuary fresco "
    "gazebo hammock igloo jasmine kiosk lagoon marble nectar oasis pewter quiver rampart sextant trellis "
    "umber vortex wicker yarrow zephyr anchor basalt citadel dune emerald ferry granite heron inlet jetty "
    "kettle lichen mantle nebula obelisk pebble quill reef sorrel tamarind upland valley wharf atlas "
    "bramble chimney delta ember forge grotto hollow isthmus juniper kelp loom mirage nomad opal pylon "
    "rune summit tide urn vineyard walnut barley candle drizzle fable gravel hinge ivory jigsaw knoll "
    "ladder mural nutmeg oxide parchment quartz ridge spindle thatch utensil vessel wagon yeast zinc "
    "the a of and to in is was for on with as by at from that this it be are or an have not which "
    "slowly bright quiet ancient northern hollow crimson gentle distant narrow heavy silver winter "
    "carries follows gathers measures shelters remembers crosses lifts paints sorts weaves mends"
).split()


def held_out_texts(count: int = 480, seed: int = 20261203) -> list[str]:
    """count texts of 12-180 words drawn from WORDS with a fixed seed."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(12, 180))]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


def write_job(path: Path, texts: list[str], model: str, per_line: int = 20) -> None:
    """OpenAI batch lines to /v1/embeddings, per_line inputs each."""
    with path.open("wb") as out:
        for i in range(0, len(texts), per_line):
            body = {"model": model, "input": texts[i : i + per_line]}
            out.write(orjson.dumps({"custom_id": f"emb-{i // per_line:03d}", "method": "POST",
                                    "url": "/v1/embeddings", "body": body}) + b"\n")


def transformers_child(texts_path: Path, out_path: Path, model: str, batch_size: int) -> None:
    """The baseline process: the transformers loop, vectors saved in input order."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from batchinfer.engine.model_files import resolve_model_path

    path = resolve_model_path(model)
    texts = orjson.loads(texts_path.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(path)
    net = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    order = sorted(range(len(texts)), key=lambda i: len(tokenizer(texts[i]).input_ids))
    vectors = torch.empty(len(texts), net.config.hidden_size)
    with torch.inference_mode():
        for at in range(0, len(order), batch_size):
            rows = order[at : at + batch_size]
            batch = tokenizer([texts[i] for i in rows], padding=True, return_tensors="pt")
            hidden = net(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            vectors[rows] = torch.nn.functional.normalize(pooled, dim=-1)
    torch.save(vectors, out_path)


def ours_vectors(output: Path, per_line: int) -> list[list[float]]:
    """The run's vectors in input order (lines by custom_id, each line's data by index)."""
    lines = [orjson.loads(line) for line in output.read_bytes().splitlines() if line.strip()]
    lines.sort(key=lambda line: line["custom_id"])
    vectors = []
    for line in lines:
        if line.get("error") or line["response"]["status_code"] != 200:
            raise SystemExit(f"line {line['custom_id']} failed: {line}")
        data = sorted(line["response"]["body"]["data"], key=lambda item: item["index"])
        if len(data) != per_line:
            raise SystemExit(f"line {line['custom_id']}: {len(data)} vectors for {per_line} inputs")
        vectors += [item["embedding"] for item in data]
    return vectors


def main() -> None:
    """Run both sides as whole processes and print the pair: wall, CPU, ratio, min cosine."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--texts", type=int, default=480)
    parser.add_argument("--per-line", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--skip-baseline", action="store_true", help="time only `batchinfer run`")
    parser.add_argument("--child", nargs=2, metavar=("TEXTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        transformers_child(Path(args.child[0]), Path(args.child[1]), args.model, args.batch_size)
        return

    import torch

    print(f"CPU: {cpu_kind()}")
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    texts = held_out_texts(args.texts)
    with tempfile.TemporaryDirectory(prefix="bench-embeddings-") as tmp_dir:
        tmp = Path(tmp_dir)
        write_job(tmp / "job.jsonl", texts, args.model, args.per_line)
        env = {**os.environ, "BATCHINFER_DATA_DIR": str(tmp / "data"), "BATCHINFER_DEFAULT_MODEL": args.model,
               "BATCHINFER_DEVICE": "cpu", "BATCHINFER_DTYPE": "float32", "PYTHONPATH": str(ROOT)}
        wall, cpu, _ = timed_child([sys.executable, "-m", "batchinfer", "run", str(tmp / "job.jsonl"), "-o",
                                    str(tmp / "out.jsonl"), "--json"], env)
        ours = torch.tensor(ours_vectors(tmp / "out.jsonl", args.per_line))
        words = sum(len(t.split()) for t in texts)
        print(f"batchinfer run   {wall:7.2f} s wall  {cpu:7.2f} s CPU  ({len(texts)} texts, {words} words: "
              f"{len(texts) / wall:.1f} texts/s, {len(texts) / max(cpu, 1e-9):.1f} texts/CPU-s)")
        if args.skip_baseline:
            return
        (tmp / "texts.json").write_bytes(orjson.dumps(texts))
        base_wall, base_cpu, _ = timed_child([sys.executable, __file__, "--model", args.model, "--batch-size",
                                              str(args.batch_size), "--child", str(tmp / "texts.json"),
                                              str(tmp / "base.pt")], env)
        base = torch.load(tmp / "base.pt")
        print(f"transformers     {base_wall:7.2f} s wall  {base_cpu:7.2f} s CPU  "
              f"({len(texts) / base_wall:.1f} texts/s, {len(texts) / max(base_cpu, 1e-9):.1f} texts/CPU-s)")
        cosine = (ours * base).sum(-1) / (ours.norm(dim=-1) * base.norm(dim=-1))
        print(f"speed: {base_wall / wall:.2f}x wall, {base_cpu / max(cpu, 1e-9):.2f}x CPU (target >= 1.5x); "
              f"min cosine {cosine.min().item():.6f} (target >= 0.999)")
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
