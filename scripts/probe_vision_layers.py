"""Which DINOv2 layer of ``smollm2-llava``'s vision tower still carries colour and shape?

    python scripts/probe_vision_layers.py --out docs/benchmarks/2026-11-26-vision-layer-cpu-x86_64

A ridge linear probe per hidden state of the frozen vision tower (0 = patch embeddings, 12 = the
last layer, before the final LayerNorm: what ``vision_feature_layer=-1`` reads). Features of one-object
scenes of training pairs fit the probe; scenes of held-out colour-shape pairs (never drawn in
training) score it, so a probe that names their colour has read colour, not memorised pairs. Two
features per image: the mean over the patches whose centre lies on the object (``object``), and the
mean over all 256 patches (``all patches``). Writes ``probe-layers.json`` and ``probe-layers.md``.

    python scripts/probe_vision_layers.py --two --model smollm2-llava --out docs/benchmarks/<date>-vision-side-cpu-x86_64

``--two``: where does a two-object scene lose its objects' colour and shape on the way to the LM?
Two-object scenes (the VQA's ``two`` generator: :func:`vlkv.eval.scenes.random_scene` with 2 objects,
left to right) of training pairs fit the probes, scenes of held-out pairs score them; one probe per
object (left, right) and word (colour, shape), from each stage the model passes them through:
the read layer's patches mean-pooled over the object (an upper bound), the projector's pooled input
tokens (the object's tokens, or all of them concatenated), the projector's output tokens (the same
two ways), and all un-pooled patches concatenated. The ridge strength of each probe is chosen by
5-fold cross-validation on the training scenes. Writes ``probe-two.json`` and ``probe-two.md``.
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


RIDGES = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5)


def probe_cv(train_x, train_y, test_x, classes: int, folds: int = 5) -> tuple[np.ndarray, float]:
    """Held-out accuracy of a standardised ridge probe onto one-hot labels, whose strength (of
    :data:`RIDGES`) is picked by ``folds``-fold cross-validation on the training rows only; returns
    its classes for ``test_x`` ``(n_test,)`` and the ridge. Solved in the dual (``n x n`` Gram matrices: the same predictions as the
    primal ridge), since the concatenated stages have far more features than scenes."""
    mu, sd = train_x.mean(0), train_x.std(0) + 1e-6
    a, b = ((train_x - mu) / sd).astype(np.float64), ((test_x - mu) / sd).astype(np.float64)
    gram, cross, onehot = a @ a.T, b @ a.T, np.eye(classes)[train_y]
    fold = np.arange(len(a)) % folds
    scores = []
    for ridge in RIDGES:
        hits = 0
        for f in range(folds):
            fit, val = fold != f, fold == f
            alpha = np.linalg.solve(gram[np.ix_(fit, fit)] + ridge * np.eye(int(fit.sum())), onehot[fit])
            hits += int(((gram[np.ix_(val, fit)] @ alpha).argmax(1) == train_y[val]).sum())
        scores.append(hits)
    ridge = RIDGES[int(np.argmax(scores))]
    alpha = np.linalg.solve(gram + ridge * np.eye(len(a)), onehot)
    return (cross @ alpha).argmax(1), ridge


# the stages a two-object scene's objects pass through, as (key, description)
STAGES = (
    ("patch_object", "(a) read-layer patches, mean over the object's patches"),
    ("pooled_object", "(b) projector input (2x2-pooled), mean over the object's tokens"),
    ("pooled_all", "(b) projector input, all pooled tokens concatenated"),
    ("proj_object", "(c) projector output, mean over the object's tokens"),
    ("proj_all", "(c) projector output, all tokens concatenated"),
    ("patch_all", "(d) read-layer patches, all 256 un-pooled concatenated"),
)


def lm_stages(layers: list[int]) -> tuple[tuple[str, str], ...]:
    """The LM's stages for ``--lm-layers``: per layer, its hidden states over the object's image tokens,
    and at the last token of "What is on the left?" (for the left object; "right" for the right)."""
    out = []
    for layer in layers:
        out.append((f"lm{layer}_object", f"(e) LM layer {layer}, mean over the object's image tokens"))
        out.append(
            (f"lm{layer}_answer", f"(f) LM layer {layer}, last prompt token of 'What is on the <side>?'")
        )
    return tuple(out)


@torch.no_grad()
def lm_features(loaded, scene, blocks: torch.Tensor, layers: list[int]) -> dict[str, np.ndarray]:
    """:func:`lm_stages` features of one scene, each ``(2, hidden)`` (left, right object).

    ``blocks``: ``(image tokens, patches per token)`` object index of each pooled token's patches."""
    from vlkv.eval.scene_tasks import ON_THE, prompt_text

    out = {}
    image_id = loaded.model.config.image_token_id
    for i, side in enumerate(("left", "right")):
        text = prompt_text(loaded, ON_THE.format(position=side), 1)
        inputs = loaded.processor(text=text, images=[scene.image()], return_tensors="pt")
        states = loaded.model(
            **inputs, output_hidden_states=True, use_cache=False, logits_to_keep=1
        ).hidden_states
        image = inputs["input_ids"][0] == image_id  # (T,): the image tokens, in raster order
        for layer in layers:
            h = states[layer][0].float()  # (T, hidden)
            if i == 0:  # the image tokens do not see the question (it comes after them)
                tokens = h[image]
                on = [(blocks == k).any(1) for k in range(2)]
                out[f"lm{layer}_object"] = torch.stack([tokens[m].mean(0) for m in on]).numpy()
                out[f"lm{layer}_answer"] = np.zeros((2, h.shape[1]), dtype=np.float32)
            out[f"lm{layer}_answer"][i] = h[-1].numpy()
    return out


@torch.no_grad()
def two_features(
    loaded, split: str, n: int, seed: int, lm_layers: list[int] = ()
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Features of ``n`` two-object scenes of ``split`` per :data:`STAGES` key (``*_object`` /
    ``*_answer``: ``(n, 2, d)``, left then right object; ``*_all``: ``(n, d_all)``), and of
    :func:`lm_stages` for ``lm_layers``, and labels ``(n, 2, 2)`` (object, [colour index, shape index])."""
    model = loaded.model.model
    processor = loaded.processor.image_processor
    layer = loaded.model.config.vision_feature_layer
    proj = model.multi_modal_projector
    pool = getattr(proj, "pool_factor", 1)
    rng = np.random.default_rng([seed, 23])
    feats: dict[str, list] = {key: [] for key, _ in STAGES + lm_stages(list(lm_layers))}
    labels = []
    for _ in range(n):
        scene = random_scene(rng, split, 2)
        pixels = processor(images=[scene.image()], return_tensors="pt")["pixel_values"]
        hidden = model.vision_tower(pixels, output_hidden_states=True).hidden_states[layer]
        patches = hidden[:, 1:].float()  # (1, P, d): what the projector reads (CLS dropped)
        side = int(round(patches.shape[1] ** 0.5))
        owner = torch.as_tensor(patch_objects(scene, processor, side)).reshape(side, side)
        pooled = proj.pool(patches) if pool > 1 else patches  # (1, P / pool², d)
        out = proj(patches).float()  # (1, P / pool², hidden)
        # a pooled token belongs to an object when any of its patches does (objects sit in distinct thirds)
        blocks = (
            owner.reshape(side // pool, pool, side // pool, pool).permute(0, 2, 1, 3).reshape(-1, pool * pool)
        )
        for key, x, own in (
            ("patch", patches, owner.reshape(-1)),
            ("pooled", pooled, blocks),
            ("proj", out, blocks),
        ):
            on = [(own == i).reshape(own.shape[0], -1).any(1) for i in range(2)]
            feats[f"{key}_object"].append(torch.stack([x[0, m].mean(0) for m in on]).numpy())
            if key != "patch":
                feats[f"{key}_all"].append(x[0].reshape(-1).numpy())
        feats["patch_all"].append(patches[0].reshape(-1).numpy())
        if lm_layers:
            for key, value in lm_features(loaded, scene, blocks, list(lm_layers)).items():
                feats[key].append(value)
        labels.append([[list(COLOURS).index(o.colour), SHAPES.index(o.shape)] for o in scene.objects])
    return {k: np.stack(v) for k, v in feats.items()}, np.array(labels)


def two_main(args) -> int:
    """``--two``: probe each stage of :data:`STAGES`; writes ``probe-two.json`` / ``probe-two.md``."""
    from vlkv.runtime.models.registry import load_model

    loaded = load_model(args.model)
    start = time.perf_counter()
    train_x, train_y = two_features(loaded, "train", args.train, args.seed, args.lm_layers)
    test_x, test_y = two_features(loaded, "heldout", args.heldout, args.seed + 1, args.lm_layers)
    seconds = time.perf_counter() - start
    rows = []
    for key, what in STAGES + lm_stages(args.lm_layers):
        row = {
            "stage": key,
            "what": what,
            "dims": int(np.prod(train_x[key].shape[2 if key.endswith(("object", "answer")) else 1 :])),
        }
        right = np.zeros(test_y.shape, dtype=bool)  # (n, object, word): the probe named it
        for i, side in enumerate(("left", "right")):
            for j, (word, k) in enumerate((("colour", len(COLOURS)), ("shape", len(SHAPES)))):
                tx = train_x[key][:, i] if key.endswith(("object", "answer")) else train_x[key]
                hx = test_x[key][:, i] if key.endswith(("object", "answer")) else test_x[key]
                guess, ridge = probe_cv(tx, train_y[:, i, j], hx, k)
                right[:, i, j] = guess == test_y[:, i, j]
                row[f"{side}_{word}"], row[f"{side}_{word}_ridge"] = float(right[:, i, j].mean()), ridge
        # an object named whole (a side question's answer), and a scene's four words (its caption)
        row["object_both"] = float(right.all(2).mean())
        row["scene_all"] = float(right.all((1, 2)).mean())
        rows.append(row)
        print(key, {k: v for k, v in row.items() if not k.endswith("ridge")}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k != "out"} | {"feature_seconds": round(seconds, 1)}
    (args.out / "probe-two.json").write_text(json.dumps({"args": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Two-object scenes of held-out pairs, n = {args.heldout} (fit on {args.train} training-pair scenes), "
        f"model {args.model}; ridge strength by 5-fold cross-validation on the training scenes.",
        "",
        "| stage | dims | left colour | left shape | right colour | right shape | object, both words | scene, all four |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['dims']} | {r['left_colour']:.2f} | {r['left_shape']:.2f} "
            f"| {r['right_colour']:.2f} | {r['right_shape']:.2f} | {r['object_both']:.2f} | {r['scene_all']:.2f} |"
        )
    (args.out / "probe-two.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for probe-layers.json / .md")
    ap.add_argument("--model", default="smollm2-llava-random", help="only the vision tower is used")
    ap.add_argument("--train", type=int, default=400, help="training-pair scenes that fit the probe")
    ap.add_argument("--heldout", type=int, default=120, help="held-out-pair scenes that score it")
    ap.add_argument("--ridge", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--two", action="store_true", help="two-object scenes, each stage to the LM (see above)")
    ap.add_argument(
        "--lm-layers", type=int, nargs="*", default=[], help="with --two: also probe these LM hidden states"
    )
    args = ap.parse_args(argv)
    if min(args.train, args.heldout) < 1:
        print("probe_vision_layers: --train and --heldout must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.two:
        return two_main(args)
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
