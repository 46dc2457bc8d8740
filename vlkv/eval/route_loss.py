"""Routing supervision (#29): the answer position's attention put on the asked object's image tokens.

The shipped model's two-object misses are mostly binding errors (the other object's words), while
probes read each object's colour and shape from the projector's output at 0.93-0.99: the LM reads the
wrong tokens. The scene generator knows where every object is drawn, so the image tokens that hold the
asked object are known; ``scripts/train_projector.py --route-loss W`` adds, per routed answer,

    W * mean over chosen layers of  -log( sum_{j in object} a_j / sum_{j in image} a_j )

where ``a`` is the row of attention probabilities (softmax over the whole causal row) at the position
that predicts the answer's first token, averaged over the layer's query heads. Averaging over heads
(rather than the best head) weights each head by the image mass it already has: heads that read the
image carry the loss, heads that attend to text or the first token are left alone, and no argmax over
heads moves between steps.

Cost: :class:`Router` hooks the chosen layers' ``q_proj`` / ``k_proj`` outputs and the rotary
``(cos, sin)`` the attention module is called with, and computes the rows itself (queries after RoPE
for the routed rows only, keys after RoPE with the GQA repeat), so the model keeps its own attention
kernel and no ``output_attentions`` is needed; the probabilities stay in the graph, so the adapters
(and the projector) get the loss's gradient.

Routed answers: every answer of a one-picture sample whose question is about one object — each
question of a one-object scene, and in two-object scenes the side questions, "left of", "colour of the
<shape>", and the caption (its first word is the left object's). Counting scenes of several objects and
several-picture samples are not routed.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor

from vlkv.eval.scene_tasks import COLOUR_OF, COLOUR_ON, LEFT_OF, ON_THE, SHAPE_ON, WHAT, Sample
from vlkv.eval.scenes import SIZE, Obj, Scene, _draw

# the ratio's denominator: all image tokens (the asked object against background and the other
# object alike), or only the scene's objects' tokens (the asked object against the other: binding;
# one-object scenes then give ratio 1 and no gradient)
OVER = ("image", "objects")


def parse_layers(spec: str, n_layers: int | None = None) -> tuple[int, ...]:
    """``"8,12"`` → ``(8, 12)``; one line naming the problem for an empty, repeated, negative or (with
    ``n_layers``) out-of-range layer."""
    try:
        layers = tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"route layers must be comma-separated integers, got {spec!r}") from None
    if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
        raise ValueError(f"route layers must be distinct non-negative integers, got {spec!r}")
    if n_layers is not None and max(layers) >= n_layers:
        raise ValueError(f"route layers {spec!r}: the LM has {n_layers} layers")
    return layers


def asked_object(scene: Scene, question: str) -> int | None:
    """Index in ``scene.objects`` of the object whose tokens answer ``question``'s first word, or None
    (counting scenes of several objects, questions about no single object)."""
    objs = scene.objects
    if len(objs) == 1:
        return 0
    if len(objs) != 2 or scene.same:
        return None
    left, right = objs
    if question == WHAT or question == LEFT_OF.format(name=right.name):
        return 0  # a caption starts with the left object
    for i, position in enumerate(("left", "right")):
        if question in (t.format(position=position) for t in (ON_THE, COLOUR_ON, SHAPE_ON)):
            return i
    for i, obj in enumerate(objs):
        if question == COLOUR_OF.format(shape=obj.shape):
            return i
    return None


@dataclass(frozen=True)
class Geometry:
    """How the processor maps a ``SIZE`` x ``SIZE`` scene to image tokens: resize to ``resize`` px,
    centre-crop ``crop`` px, a ``side`` x ``side`` raster of tokens (row-major) over the crop."""

    resize: int = 256
    crop: int = 224
    side: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.crop <= self.resize or self.side < 1:
            raise ValueError(f"geometry needs 0 < crop <= resize and side >= 1, got {self}")


def geometry_of(loaded, n_tokens: int) -> Geometry:
    """``loaded``'s processor geometry for images of ``n_tokens`` tokens (a square raster)."""
    side = math.isqrt(n_tokens)
    if side * side != n_tokens:
        raise ValueError(f"routing needs a square token raster, got {n_tokens} tokens per image")
    ip = loaded.processor.image_processor
    size = getattr(ip, "size", None) or {}
    resize = size.get("shortest_edge") or size.get("height") or SIZE
    crop = ip.crop_size["height"] if getattr(ip, "do_center_crop", False) else resize
    return Geometry(int(resize), int(crop), side)


def object_mask(obj: Obj, geo: Geometry) -> Tensor:
    """``(side²,)`` bool: the tokens whose pooled patches hold any pixel of ``obj`` as drawn."""
    img = Image.new("L", (SIZE, SIZE), 0)
    draw = ImageDraw.Draw(img)
    # the scene's own shape code, every fill and outline painted 255 (the colour does not matter)
    _draw(_Mono(draw), obj)
    px = np.asarray(img.resize((geo.resize, geo.resize), Image.NEAREST)) > 0
    off = (geo.resize - geo.crop) // 2
    px = px[off : off + geo.crop, off : off + geo.crop]
    edges = np.linspace(0, geo.crop, geo.side + 1).round().astype(int)
    cells = [
        px[edges[r] : edges[r + 1], edges[c] : edges[c + 1]].any()
        for r in range(geo.side)
        for c in range(geo.side)
    ]
    return torch.tensor(cells)


class _Mono:
    """An ``ImageDraw`` proxy that paints every shape (fill and outline) with 255."""

    def __init__(self, draw: ImageDraw.ImageDraw) -> None:
        self._draw = draw

    def __getattr__(self, name):
        method = getattr(self._draw, name)
        return lambda *a, **kw: method(*a, **(kw | {"fill": 255, "outline": 255}))


def target_mask(scene: Scene, index: int, geo: Geometry) -> Tensor:
    """``(side²,)`` bool: tokens that hold object ``index`` and no other object of ``scene``."""
    masks = [object_mask(o, geo) for o in scene.objects]
    others = torch.zeros_like(masks[index])
    for i, m in enumerate(masks):
        if i != index:
            others |= m
    return masks[index] & ~others


@dataclass(frozen=True)
class RouteRow:
    """One routed answer: ``row`` the sequence position predicting its first token, ``target`` and
    ``image`` the positions of the asked object's tokens and of all image tokens, ``other`` those of
    the scene's other objects (none in one-object scenes) (each ``(n,)`` int64)."""

    row: int
    target: Tensor
    image: Tensor
    other: Tensor


def plan(loaded, sample: Sample, ids: Tensor, answer_mask: Tensor, image_token_id: int) -> list[RouteRow]:
    """The routed rows of ``sample`` encoded as ``ids`` ``(T,)``; ``answer_mask`` ``(T,)`` marks the
    answers' tokens (each answer one run, in turn order: the question's, then the follow-ups')."""
    if len(sample.scenes) != 1:
        return []
    image = (ids == image_token_id).nonzero().flatten()
    if image.numel() == 0:
        return []
    geo = geometry_of(loaded, image.numel())
    starts = (answer_mask & ~torch.cat([torch.zeros(1, dtype=torch.bool), answer_mask[:-1]])).nonzero()
    questions = [sample.question] + [q for q, _ in sample.turns]
    if len(starts) != len(questions):
        raise ValueError(f"{len(starts)} answers in the tokens for {len(questions)} questions")
    rows, masks = [], {}
    scene = sample.scenes[0]
    for start, question in zip(starts.flatten().tolist(), questions, strict=True):
        index = asked_object(scene, question)
        if index is None:
            continue
        for i in (index, 1 - index) if len(scene.objects) == 2 else (index,):
            if i not in masks:
                masks[i] = target_mask(scene, i, geo)
        other = masks[1 - index] if len(scene.objects) == 2 else torch.zeros_like(masks[index])
        if masks[index].any():
            rows.append(RouteRow(start - 1, image[masks[index]], image, image[other]))
    return rows


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Llama's rotary embedding: ``x`` ``(1, H, n, D)``, ``cos`` / ``sin`` ``(1, n, D)``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def row_probs(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, rows: Tensor, heads: int, scale: float
) -> Tensor:
    """Attention probabilities ``(H, R, T)`` (float32) of query rows ``rows`` ``(R,)``, causal.

    ``q`` ``(1, T, H*D)`` and ``k`` ``(1, T, H_kv*D)``: the projections' outputs before RoPE;
    ``cos`` / ``sin`` ``(1, T, D)``. Query head ``h`` reads key head ``h // (H / H_kv)`` (GQA repeat).
    """
    t = k.shape[1]
    d = q.shape[-1] // heads
    kv = k.shape[-1] // d
    qr = q[:, rows].reshape(1, len(rows), heads, d).transpose(1, 2).float()
    qr = _rope(qr, cos[:, rows].float(), sin[:, rows].float())
    kr = _rope(k.reshape(1, t, kv, d).transpose(1, 2).float(), cos.float(), sin.float())
    kr = kr.repeat_interleave(heads // kv, dim=1)
    logits = (qr @ kr.transpose(-1, -2))[0] * scale
    later = torch.arange(t, device=q.device)[None, :] > rows[:, None]
    return logits.masked_fill(later[None], float("-inf")).softmax(dim=-1)


class Router:
    """Records the routed rows' attention in ``layers`` while ``sample`` runs through ``loaded.model``.

    Use as a context manager around the sample's forward (only forwards with image tokens are routed:
    a text-form teacher's forward passes through untouched). :meth:`loss` then gives the route loss
    (a 0-d tensor in the graph) and :attr:`ratio` the mean object share of the image mass (a float).
    """

    def __init__(
        self, loaded, sample: Sample, layers: tuple[int, ...], swaps=(), over: str = "image"
    ) -> None:
        from vlkv.eval.answer_noise import answer_tokens

        if over not in OVER:
            raise ValueError(f"route over must be one of {list(OVER)}, got {over!r}")
        self.loaded, self.sample, self.layers, self.over = loaded, sample, layers, over
        _, self._answer_mask, _ = answer_tokens(loaded, sample, swaps)
        self.rows: list[RouteRow] = []
        self.probs: dict[int, Tensor] = {}
        self._handles, self._seen, self._active = [], {}, False

    def __enter__(self) -> Router:
        model = self.loaded.model
        blocks = model.model.language_model.layers
        parse_layers(",".join(map(str, self.layers)), len(blocks))
        self._handles.append(model.register_forward_pre_hook(self._start, with_kwargs=True))
        for layer in self.layers:
            attn = blocks[layer].self_attn
            self._handles.append(attn.register_forward_pre_hook(self._rotary(layer), with_kwargs=True))
            self._handles.append(attn.q_proj.register_forward_hook(self._keep(layer, "q")))
            self._handles.append(attn.k_proj.register_forward_hook(self._keep(layer, "k")))
            self._handles.append(attn.register_forward_hook(self._finish(layer, attn)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _start(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        image_token = self.loaded.model.config.image_token_id
        # only a forward with image tokens is routed (and replaces what an earlier one recorded)
        self._active = ids is not None and ids.shape[0] == 1 and bool((ids == image_token).any())
        if not self._active:
            return
        n = self._answer_mask.numel()
        mask = torch.cat([torch.zeros(ids.shape[1] - n, dtype=torch.bool), self._answer_mask])
        self.rows, self.probs = plan(self.loaded, self.sample, ids[0], mask, image_token), {}
        self._active = bool(self.rows)

    def _rotary(self, layer):
        def hook(module, args, kwargs):
            if self._active:
                self._seen[(layer, "rope")] = kwargs["position_embeddings"]

        return hook

    def _keep(self, layer, name):
        def hook(module, args, output):
            if self._active:
                self._seen[(layer, name)] = output

        return hook

    def _finish(self, layer, attn):
        def hook(module, args, output):
            if not self._active:
                return
            cos, sin = self._seen.pop((layer, "rope"))
            q, k = self._seen.pop((layer, "q")), self._seen.pop((layer, "k"))
            rows = torch.tensor([r.row for r in self.rows])
            heads = attn.config.num_attention_heads
            self.probs[layer] = row_probs(q, k, cos, sin, rows, heads, attn.scaling)

        return hook

    def ratios(self, of: str = "target", over: str | None = None) -> Tensor:
        """``(layers, R)``: per layer and routed row, the head-mean attention on the asked object's
        tokens (``of="other"``: the other object's) over that on all image tokens (``over="image"``)
        or on both objects' tokens (``"objects"``; default: the Router's ``over``), in the graph."""
        over = over or self.over
        out = []
        for layer in self.layers:
            mean = self.probs[layer].mean(dim=0)  # (R, T)
            ratios = []
            for i, r in enumerate(self.rows):
                whole = r.image if over == "image" else torch.cat([r.target, r.other])
                ratios.append(mean[i, getattr(r, of)].sum() / mean[i, whole].sum())
            out.append(torch.stack(ratios))
        return torch.stack(out)

    def loss(self) -> Tensor:
        """Mean over layers and routed rows of ``-log(ratio)``; 0 (no graph) when nothing was routed."""
        if not self.rows or not self.probs:
            return torch.zeros(())
        return -self.ratios().clamp_min(1e-12).log().mean()

    @property
    def ratio(self) -> float:
        """The mean ratio over layers and routed rows (nan when nothing was routed)."""
        if not self.rows or not self.probs:
            return float("nan")
        return self.ratios().mean().item()


def maybe(loaded, sample: Sample, layers: str, weight: float, swaps=(), over: str = "image"):
    """A :class:`Router` over ``layers`` (``"13,16"``) when ``weight > 0``, else a context yielding None
    (nothing hooked: the step is today's)."""
    if weight <= 0:
        return nullcontext()
    return Router(loaded, sample, parse_layers(layers), swaps, over)


def summary(routed: list[tuple[float, float]], weight: float, batch: int) -> dict | None:
    """A step's log entry from its routed samples' ``(ratio, -log ratio)`` pairs: the mean ratio and
    the route term's share of the step's loss (``weight x`` its sum ``/ batch``); None if none routed."""
    kept = [(r, t) for r, t in routed if r == r]  # nan: a sample with nothing routed
    if not kept:
        return None
    mean = sum(r for r, _ in kept) / len(kept)
    return {"ratio": round(mean, 4), "term": round(weight * sum(t for _, t in kept) / batch, 5)}


def heldout_samples(n: int, seed: int, split: str = "heldout") -> list[Sample]:
    """``n`` routed two-object questions about ``split``'s pairs (:func:`vlkv.eval.scene_tasks.two`)."""
    from vlkv.eval.scene_tasks import two

    rng = np.random.default_rng([seed, 29])
    out: list[Sample] = []
    while len(out) < n:
        sample = two(rng, split)
        if asked_object(sample.scenes[0], sample.question) is not None:
            out.append(sample)
    return out


@torch.no_grad()
def measure(loaded, samples: list[Sample], layers: tuple[int, ...]) -> dict:
    """Mean route ratio per layer over ``samples`` (answers teacher-forced; the routed row comes
    before them), the same for the other object's tokens (``other``), the asked object's share of
    both objects' mass (``objects``), and the ratio uniform attention over the image would give the
    asked object (``chance``)."""
    from vlkv.eval.answer_noise import answer_tokens
    from vlkv.eval.scene_tasks import prompt_text

    sums, others, binds = torch.zeros(len(layers)), torch.zeros(len(layers)), torch.zeros(len(layers))
    chance, n = 0.0, 0
    for sample in samples:
        prompt = prompt_text(loaded, sample.question, 1)
        inputs = loaded.processor(text=prompt, images=[sample.scenes[0].image()], return_tensors="pt")
        ids, _, _ = answer_tokens(loaded, sample)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], ids], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        with Router(loaded, sample, layers) as router:
            loaded.model(**inputs, logits_to_keep=1, use_cache=False)
        sums += router.ratios(over="image").sum(dim=1)
        others += router.ratios("other", over="image").sum(dim=1)
        binds += router.ratios(over="objects").sum(dim=1)
        chance += sum(len(r.target) / len(r.image) for r in router.rows)
        n += len(router.rows)

    def per_layer(t: Tensor) -> dict[int, float]:
        return {layer: round(v / n, 4) for layer, v in zip(layers, t.tolist())}

    record = {"rows": n, "chance": round(chance / n, 4), "ratio": per_layer(sums), "other": per_layer(others)}
    return record | {"objects": per_layer(binds)}


def main(argv: list[str] | None = None) -> int:
    """``python -m vlkv.eval.route_loss --projector CKPT``: held-out route ratios per layer (JSON)."""
    import argparse
    import json
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m vlkv.eval.route_loss", description=main.__doc__)
    ap.add_argument(
        "--projector", type=Path, required=True, help="a train_projector checkpoint or safetensors"
    )
    ap.add_argument("--layers", default="all", help="comma-separated LM layers, or 'all'")
    ap.add_argument("--n", type=int, default=32, help="held-out two-object questions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="heldout", help="the pairs asked about: heldout or train")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        from vlkv.eval.vqa import _swap_projector
        from vlkv.runtime.models.registry import load_model

        loaded = load_model("smollm2-llava-random")
        _swap_projector(loaded, args.projector)
        n_layers = len(loaded.model.model.language_model.layers)
        layers = tuple(range(n_layers)) if args.layers == "all" else parse_layers(args.layers, n_layers)
        record = {"projector": args.projector.name, "n": args.n, "seed": args.seed, "split": args.split}
        record |= measure(loaded, heldout_samples(args.n, args.seed, args.split), layers)
    except ValueError as exc:
        print(f"route_loss: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    text = json.dumps(record)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
