"""Which DINOv2 layer of ``smollm2-llava``'s vision tower still carries colour and shape?

    python scripts/probe_vision_layers.py --out docs/benchmarks/2026-11-26-vision-layer-cpu-x86_64

A ridge linear probe per hidden state of the frozen vision tower (0 = patch embeddings, 12 = the
last layer, before the final LayerNorm: what ``vision_feature_layer=-1`` reads). Features of one-object
scenes of training pairs fit the probe; scenes of held-out colour-shape pairs (never drawn in
training) score it, so a probe that names their colour has read colour, not memorised pairs. Two
features per image: the mean over the patches whose centre lies on the object (``object``), and the
mean over all 256 patches (``all patches``). Writes ``probe-layers.json`` and ``probe-layers.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vlkv.eval.projector_init import patch_objects
from vlkv.eval.scenes import COLOURS, SHAPES, random_scene


@torch.no_grad()
def features(loaded, split: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(layers, n, 2 * d)`` features (object mean, all-patch mean), colour and shape labels ``(n,)``."""
    tower = loaded.model.model.vision_tower
    processor = loaded.processor.image_processor
    rng = np.random.default_rng([seed, 17])
    rows, colours, shapes = [], [], []
    for _ in range(n):
        scene = random_scene(rng, split, 1)
        pixels = processor(images=[scene.image()], return_tensors="pt")["pixel_values"]
        hidden = tower(pixels, output_hidden_states=True).hidden_states  # layers + 1 of (1, 1 + P, d)
        patches = torch.stack([h[0, 1:] for h in hidden])  # (layers + 1, P, d)
        owner = patch_objects(scene, processor, int(round(patches.shape[1] ** 0.5)))
        on = torch.as_tensor(owner >= 0)
        rows.append(torch.cat([patches[:, on].mean(1), patches.mean(1)], dim=-1).numpy())
        obj = scene.objects[0]
        colours.append(list(COLOURS).index(obj.colour))
        shapes.append(SHAPES.index(obj.shape))
    return np.stack(rows, axis=1), np.array(colours), np.array(shapes)


def probe_accuracy(train_x, train_y, test_x, test_y, classes: int, ridge: float) -> float:
    """Standardised ridge regression onto one-hot labels; held-out accuracy of its argmax."""
    mu, sd = train_x.mean(0), train_x.std(0) + 1e-6
    a, b = (train_x - mu) / sd, (test_x - mu) / sd
    w = np.linalg.solve(a.T @ a + ridge * np.eye(a.shape[1]), a.T @ np.eye(classes)[train_y])
    return float(((b @ w).argmax(1) == test_y).mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for probe-layers.json / .md")
    ap.add_argument("--model", default="smollm2-llava-random", help="only the vision tower is used")
    ap.add_argument("--train", type=int, default=400, help="training-pair scenes that fit the probe")
    ap.add_argument("--heldout", type=int, default=120, help="held-out-pair scenes that score it")
    ap.add_argument("--ridge", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if min(args.train, args.heldout) < 1:
        print("probe_vision_layers: --train and --heldout must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from vlkv.runtime.models.registry import load_model

    loaded = load_model(args.model)
    start = time.perf_counter()
    train_x, train_c, train_s = features(loaded, "train", args.train, args.seed)
    test_x, test_c, test_s = features(loaded, "heldout", args.heldout, args.seed + 1)
    seconds = time.perf_counter() - start
    d = train_x.shape[-1] // 2
    rows = []
    for layer in range(train_x.shape[0]):
        row = {"layer": layer}
        for part, cols in (("object", slice(0, d)), ("all", slice(d, 2 * d))):
            for name, y, yt, k in (
                ("colour", train_c, test_c, len(COLOURS)),
                ("shape", train_s, test_s, len(SHAPES)),
            ):
                row[f"{name}_{part}"] = probe_accuracy(
                    train_x[layer][:, cols], y, test_x[layer][:, cols], yt, k, args.ridge
                )
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k != "out"} | {"feature_seconds": round(seconds, 1)}
    (args.out / "probe-layers.json").write_text(json.dumps({"args": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Held-out pairs, n = {args.heldout} (fit on {args.train} training-pair scenes), ridge {args.ridge}.",
        "",
        "| layer | colour, object patches | shape, object patches | colour, all patches | shape, all patches |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['colour_object']:.2f} | {r['shape_object']:.2f} "
            f"| {r['colour_all']:.2f} | {r['shape_all']:.2f} |"
        )
    (args.out / "probe-layers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
