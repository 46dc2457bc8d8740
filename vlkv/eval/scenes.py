"""Procedural scenes: coloured shapes on plain or noisy backgrounds, with the words that describe them.

Everything an image shows is chosen here and drawn with PIL, so training and evaluation data need
no download and every answer is known exactly. A scene holds 1–3 objects; each object is one
colour–shape *pair*. :data:`HELD_OUT` pairs are never drawn by the training split, so a model that
names them correctly has learned colour and shape separately, not memorised pairs.

Positions are thirds of the width (``left`` / ``middle`` / ``right``); objects keep a margin so the
processor's 256→224 centre crop never cuts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (250, 250, 250),
    "black": (10, 10, 10),
    "orange": (245, 130, 20),
    "purple": (130, 40, 190),
}
SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon", "cross")
POSITIONS = ("left", "middle", "right")
NUMBERS = ("zero", "one", "two", "three")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
# One per colour (8 of 56 pairs, 14 %), seven shapes among them: every colour is still seen in
# training with 6 shapes and every shape with 6-7 colours, so naming a held-out pair needs colour and
# shape read separately (with 6 colours x 4 shapes the model memorised pairs instead).
HELD_OUT: frozenset[tuple[str, str]] = frozenset(
    {
        ("red", "star"),
        ("green", "circle"),
        ("blue", "triangle"),
        ("yellow", "square"),
        ("white", "diamond"),
        ("black", "hexagon"),
        ("orange", "cross"),
        ("purple", "star"),
    }
)
SPLITS = ("train", "heldout")
SIZE = 224  # the vision tower's input side; drawn at it so the processor hardly resamples
MARGIN = 18  # > (256 - 224) / 2 * 224 / 256 = 14 px lost to the centre crop on each side


def pairs(split: str) -> list[tuple[str, str]]:
    """The colour–shape pairs a split draws from, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    every = [(c, s) for c in COLOURS for s in SHAPES]
    return [p for p in every if (p in HELD_OUT) == (split == "heldout")]


def plural(shape: str) -> str:
    """``"stars"``, ``"crosses"``."""
    return shape + ("es" if shape.endswith(("s", "x", "sh", "ch")) else "s")


@dataclass(frozen=True)
class Obj:
    """One drawn shape: its pair, its third of the width, and its centre/radius in pixels."""

    colour: str
    shape: str
    position: str
    cx: int
    cy: int
    radius: int

    def __post_init__(self) -> None:
        if self.colour not in COLOURS:
            raise ValueError(f"colour must be one of {list(COLOURS)}, got {self.colour!r}")
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {list(SHAPES)}, got {self.shape!r}")
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {list(POSITIONS)}, got {self.position!r}")

    @property
    def name(self) -> str:
        """``"red star"``."""
        return f"{self.colour} {self.shape}"


@dataclass(frozen=True)
class Scene:
    """Objects sorted left to right, and how the background is drawn (``grey`` level, ``noise`` seed)."""

    objects: tuple[Obj, ...]
    grey: int
    noise_seed: int  # -1: plain background

    def __post_init__(self) -> None:
        if not 1 <= len(self.objects) <= 3:
            raise ValueError(f"objects must hold 1-3 shapes, got {len(self.objects)}")

    def image(self) -> Image.Image:
        """The scene drawn as a ``SIZE``×``SIZE`` RGB image."""
        if self.noise_seed >= 0:
            rng = np.random.default_rng(self.noise_seed)
            pixels = self.grey + rng.integers(-40, 41, (SIZE, SIZE, 3))
            img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        else:
            img = Image.new("RGB", (SIZE, SIZE), (self.grey,) * 3)
        draw = ImageDraw.Draw(img)
        for obj in self.objects:
            _draw(draw, obj)
        return img

    @property
    def caption(self) -> str:
        """``"red star"``, ``"red star and blue circle"`` (left to right), ``"two red stars"``."""
        if self.same:
            obj = self.objects[0]
            return f"{NUMBERS[len(self.objects)]} {obj.colour} {plural(obj.shape)}"
        return " and ".join(o.name for o in self.objects)

    @property
    def same(self) -> bool:
        """Several objects, all of one pair (a counting scene)."""
        return len(self.objects) > 1 and len({(o.colour, o.shape) for o in self.objects}) == 1


def _draw(draw: ImageDraw.ImageDraw, obj: Obj) -> None:
    fill = COLOURS[obj.colour]
    # white/black shapes get a thin dark/light outline so they stay visible on any grey
    outline = (90, 90, 90)
    x, y, r = obj.cx, obj.cy, obj.radius
    if obj.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill, outline=outline)
    elif obj.shape == "square":
        s = int(r * 0.85)
        draw.rectangle((x - s, y - s, x + s, y + s), fill=fill, outline=outline)
    elif obj.shape == "triangle":
        draw.polygon(
            [(x, y - r), (x - r, y + int(r * 0.8)), (x + r, y + int(r * 0.8))], fill=fill, outline=outline
        )
    elif obj.shape == "diamond":
        w = int(r * 0.75)
        draw.polygon([(x, y - r), (x + w, y), (x, y + r), (x - w, y)], fill=fill, outline=outline)
    elif obj.shape == "hexagon":
        angles = np.arange(6) * np.pi / 3
        draw.polygon([(x + r * np.cos(a), y - r * np.sin(a)) for a in angles], fill=fill, outline=outline)
    elif obj.shape == "cross":
        a, w = r * 0.9, r * 0.32
        points = [(w, a), (w, w), (a, w), (a, -w), (w, -w), (w, -a)]
        points += [(-px, -py) for px, py in points]
        draw.polygon([(x + px, y + py) for px, py in points], fill=fill, outline=outline)
    else:
        angles = np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
        points = [(x + rr * np.cos(a), y - rr * np.sin(a)) for a, rr in zip(angles, radii, strict=True)]
        draw.polygon(points, fill=fill, outline=outline)


def random_scene(
    rng: np.random.Generator,
    split: str,
    n_objects: int,
    same: bool = False,
    pair: tuple[str, str] | None = None,
) -> Scene:
    """A scene of ``n_objects`` shapes in distinct thirds, pairs drawn from ``split``.

    ``same``: every object is one pair (a counting scene). ``pair``: the first object's pair (a
    pair of another split is allowed: the caller asks for it explicitly). Different objects of a
    non-``same`` scene have different pairs.
    """
    if not 1 <= n_objects <= 3:
        raise ValueError(f"n_objects must be 1-3, got {n_objects}")
    pool = pairs(split)
    first = pair if pair is not None else pool[rng.integers(len(pool))]
    chosen = [first]
    while len(chosen) < n_objects:
        candidate = first if same else pool[rng.integers(len(pool))]
        if same or candidate not in chosen:
            chosen.append(candidate)
    thirds = sorted(rng.choice(3, size=n_objects, replace=False)) if n_objects > 1 else [rng.integers(3)]
    order = rng.permutation(n_objects)  # which pair lands in which third
    third = SIZE / 3
    objects = []
    for slot, idx in zip(thirds, order, strict=True):
        colour, shape = chosen[idx]
        radius = int(rng.integers(18, 26)) if n_objects > 1 else int(rng.integers(24, 40))
        lo = max(int(slot * third) + radius, MARGIN + radius) if n_objects > 1 else MARGIN + radius
        hi = (
            min(int((slot + 1) * third) - radius, SIZE - MARGIN - radius)
            if n_objects > 1
            else SIZE - MARGIN - radius
        )
        if n_objects == 1:
            # a single object's third is where its centre lies
            lo, hi = (max(lo, int(slot * third)), min(hi, int((slot + 1) * third) - 1))
        cx = int(rng.integers(lo, max(lo, hi) + 1))
        cy = int(rng.integers(MARGIN + radius, SIZE - MARGIN - radius + 1))
        objects.append(Obj(colour, shape, POSITIONS[slot], cx, cy, radius))
    objects.sort(key=lambda o: o.cx)
    noisy = rng.random() < 0.5
    return Scene(
        tuple(objects),
        grey=int(rng.integers(90, 166)),
        noise_seed=int(rng.integers(1 << 30)) if noisy else -1,
    )


def make_scene(names: list[str], seed: int = 0, noise: bool = False) -> Scene:
    """A scene of the named objects (``"red star"``), left to right in distinct thirds.

    One object sits in the middle third; sizes and exact places are drawn from ``seed``.
    """
    if not 1 <= len(names) <= 3:
        raise ValueError(f"a scene holds 1-3 objects, got {len(names)}")
    rng = np.random.default_rng(seed)
    slots = {1: [1], 2: [0, 2], 3: [0, 1, 2]}[len(names)]
    third = SIZE / 3
    objects = []
    for name, slot in zip(names, slots, strict=True):
        parts = name.lower().split()
        if len(parts) != 2 or parts[0] not in COLOURS or parts[1] not in SHAPES:
            raise ValueError(
                f"object {name!r} must be 'COLOUR SHAPE' with COLOUR in {', '.join(COLOURS)} "
                f"and SHAPE in {', '.join(SHAPES)}"
            )
        radius = int(rng.integers(24, 36)) if len(names) == 1 else int(rng.integers(18, 24))
        cx = int((slot + 0.5) * third)
        cy = int(rng.integers(MARGIN + radius, SIZE - MARGIN - radius + 1))
        objects.append(Obj(parts[0], parts[1], POSITIONS[slot], cx, cy, radius))
    grey = int(rng.integers(90, 166))
    return Scene(tuple(objects), grey=grey, noise_seed=int(rng.integers(1 << 30)) if noise else -1)


def main(argv: list[str] | None = None) -> int:
    """``python -m vlkv.eval.scenes "red star" "blue circle" --out scene.png``: draw a scene to a file."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(
        prog="python -m vlkv.eval.scenes", description="draw a scene of coloured shapes"
    )
    ap.add_argument(
        "objects", nargs="+", help="1-3 objects, left to right, each 'COLOUR SHAPE' (e.g. 'red star')"
    )
    ap.add_argument("--out", required=True, help="image file to write (PNG)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", action="store_true", help="noisy background")
    args = ap.parse_args(argv)
    try:
        scene = make_scene(args.objects, args.seed, args.noise)
        scene.image().save(args.out)
    except (ValueError, OSError) as exc:
        print(f"scenes: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"{args.out}: {scene.caption}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
