"""Ridge initialisation of a LLaVA projector: frozen vision features regressed onto word embeddings.

The map is written *exactly* into the 2-layer GELU MLP: ``linear_1`` holds ± copies of the top
principal directions of the features, so ``gelu(z) - gelu(-z) = z`` passes them through, and
``linear_2`` holds the ridge coefficients (``shared/spec/projector-training.md``).

The hidden units' scale is free (``gelu(sz) - gelu(-sz) = sz``; ``linear_2`` divides by ``s``):
``hidden="unit"`` picks ``s`` so their pre-activations have unit RMS on the fit's data, ``"raw"``
keeps ``s = 1``. It changes nothing at initialisation, only how far an optimiser step moves each
layer: mid-layer DINOv2 features are ~20x smaller than the last layer's (token norm ~2 against ~42),
and unscaled, ``linear_2`` holds ~20x larger coefficients that Adam's fixed-size steps hardly move.

Two targets (``target``):

- ``global``: every patch of a one-object scene → the mean input embedding of the object's colour
  word and shape word (the measured recipe: patch features are contextual, so every patch can say
  what the image holds);
- ``local``: one- and two-object scenes; a patch whose centre lies on an object → that object's
  words, every other patch → the word "background". The image tokens then say *where* each object
  is through their place in the sequence, which a two-object caption ("red star and blue circle",
  left to right) needs. Object patches are weighted to half the fit, since they are ~6 % of patches.
- ``local-pos``: as ``local``, but an object's patches → the mean of its colour, shape *and*
  position word (``left`` / ``middle`` / ``right``), so each image token says where its object is
  in words ("red star left") instead of only through its place in the row-major patch sequence, in
  which the patches of a left and a right object interleave row by row.

:func:`position_start` installs the projector's separate position term instead (the ``thirds``
start, :func:`thirds_bias`), which adds the position word on top of any of these targets.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vlkv.eval.scenes import POSITIONS, SIZE, Scene, random_scene

TARGETS = ("global", "local", "local-pos")
# the projector's learned per-patch term (vlkv.runtime.models.projector_position) and how it starts
POSITION_BIASES = ("none", "thirds")
HIDDEN = ("unit", "raw")
BACKGROUND = "background"


def word_target(loaded, word: str, leading_space: bool) -> torch.Tensor:
    """Mean input embedding of ``word``'s tokens as they appear in an answer; ``(hidden,)``."""
    tok = loaded.processor.tokenizer
    ids = tok((" " if leading_space else "") + word, add_special_tokens=False)["input_ids"]
    embed = loaded.model.get_input_embeddings().weight
    return embed[ids].float().mean(0)


def object_target(loaded, obj, with_position: bool = False) -> torch.Tensor:
    """Mean of the colour word's and shape word's targets (and the position word's); ``(hidden,)``.

    The position word is taken as an answer starts with it ("Where is the red star?" → "left").
    """
    words = [word_target(loaded, obj.colour, False), word_target(loaded, obj.shape, True)]
    if with_position:
        words.append(word_target(loaded, obj.position, False))
    return torch.stack(words).mean(0)


def patch_targets(loaded, scene: Scene, owner: np.ndarray, target: str) -> torch.Tensor:
    """Each patch's regression target for a ``local``/``local-pos`` fit; ``(patches, hidden)``.

    ``owner``: :func:`patch_objects`'s ``(patches,)`` object index per patch (``-1``: background).
    """
    if target not in ("local", "local-pos"):
        raise ValueError(f"patch targets are for local or local-pos, got {target!r}")
    background = word_target(loaded, BACKGROUND, False)
    objects = [object_target(loaded, o, target == "local-pos") for o in scene.objects]
    return torch.stack([background, *objects])[torch.as_tensor(owner + 1)]


def patch_objects(scene: Scene, image_processor, grid: int) -> np.ndarray:
    """Which object each patch's centre lies on (``-1``: none); ``(grid * grid,)``, row-major.

    Follows the processor's resize of the shortest edge and centre crop (both optional).
    """
    centres, half = patch_centres(image_processor, grid)
    ys, xs = np.meshgrid(centres, centres, indexing="ij")
    owner = np.full((grid, grid), -1)
    for i, obj in enumerate(scene.objects):
        # a patch whose centre is within the shape's radius (+ half a patch) shows part of it
        reach = obj.radius + half
        owner[(xs - obj.cx) ** 2 + (ys - obj.cy) ** 2 <= reach**2] = i
    return owner.reshape(-1)


def patch_centres(image_processor, grid: int) -> tuple[np.ndarray, float]:
    """The patch centres along one side in scene pixels ``(grid,)``, and half a patch's side in them.

    Follows the processor's resize of the shortest edge and centre crop (both optional).
    """
    resize = getattr(image_processor, "size", None)
    edge = getattr(resize, "shortest_edge", None) if getattr(image_processor, "do_resize", False) else None
    scale = (edge or SIZE) / SIZE
    crop = getattr(image_processor, "crop_size", None)
    side = getattr(crop, "height", None) if getattr(image_processor, "do_center_crop", False) else None
    side = side or SIZE * scale
    offset = (SIZE * scale - side) / 2
    centres = (np.arange(grid) + 0.5) * side / grid + offset  # patch centres in scaled pixels
    return centres / scale, 0.5 * side / grid / scale


def column_positions(image_processor, grid: int) -> list[str]:
    """Each patch column's third of the scene's width (``left`` / ``middle`` / ``right``, the words
    :mod:`vlkv.eval.scenes` places objects by); ``grid`` entries."""
    centres, _ = patch_centres(image_processor, grid)
    return [POSITIONS[min(len(POSITIONS) - 1, int(x // (SIZE / len(POSITIONS))))] for x in centres]


@torch.no_grad()
def thirds_bias(loaded, alpha: float, num_patches: int) -> torch.Tensor:
    """The ``thirds`` position bias: patch ``p`` → ``alpha`` × the input embedding of its column's
    position word, taken as an answer starts with it ("Where is the red star?" → "left");
    ``(num_patches, hidden)``, row-major like the image tokens.

    ``alpha = 0.5`` gives the word the share a colour word has in a ``local`` target (the mean of the
    colour and shape words), added to it rather than taking a third of it as ``local-pos`` does.
    """
    grid = int(round(num_patches**0.5))
    if grid * grid != num_patches:
        raise ValueError(f"num_patches must be a square grid, got {num_patches}")
    words = {w: word_target(loaded, w, False) for w in POSITIONS}
    columns = torch.stack([words[w] for w in column_positions(loaded.processor.image_processor, grid)])
    return (alpha * columns).repeat(grid, 1)  # row-major: every row has the same columns


@torch.no_grad()
def ridge_init(
    loaded, seed: int, n_images: int, ridge: float, target: str = "global", hidden: str = "unit"
) -> tuple[dict[str, float], AffineProjector]:
    """Fit patch features → word embeddings (``target``) and write the map into the projector.

    Returns the fit's R² on its own data, its rank, the hidden units' scale and the time it took;
    and the map itself.
    """
    if target not in TARGETS:
        raise ValueError(f"init target must be one of {list(TARGETS)}, got {target!r}")
    if hidden not in HIDDEN:
        raise ValueError(f"init hidden scale must be one of {list(HIDDEN)}, got {hidden!r}")
    start = time.perf_counter()
    proj = loaded.model.model.multi_modal_projector
    captured: list[torch.Tensor] = []
    hook = proj.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach().float()))
    rng = np.random.default_rng([seed, 1_000_003])
    feats, targets, weights = [], [], []
    try:
        for i in range(n_images):
            scene = random_scene(rng, "train", 1 if target == "global" or i % 2 == 0 else 2)
            pixels = loaded.processor.image_processor(images=[scene.image()], return_tensors="pt")[
                "pixel_values"
            ]
            captured.clear()
            loaded.model.model.get_image_features(pixel_values=pixels.to(loaded.model.dtype))
            # a pooled projector's MLP reads block means: fit what it reads, one row per image token
            pool = getattr(proj, "pool", None)
            features = captured[-1] if pool is None else pool(captured[-1])
            patches = features.reshape(-1, features.shape[-1])  # (tokens, vision_hidden)
            n = patches.shape[0]
            if target == "global":
                y = object_target(loaded, scene.objects[0]).expand(n, -1)
                w = torch.ones(n)
            else:
                owner = patch_objects(scene, loaded.processor.image_processor, int(round(n**0.5)))
                y = patch_targets(loaded, scene, owner, target)
                on = torch.as_tensor(owner >= 0)
                # object patches and background patches each carry half of the image's weight
                w = torch.where(on, 0.5 / max(1, int(on.sum())), 0.5 / max(1, int((~on).sum()))) * n
            feats.append(patches)
            targets.append(y)
            weights.append(w)
    finally:
        hook.remove()
    x = torch.cat(feats).double()  # (N, d)
    y = torch.cat(targets).double()  # (N, out)
    w = torch.cat(weights).double()[:, None]  # (N, 1)
    mu, y_mean = (w * x).sum(0) / w.sum(), (w * y).sum(0) / w.sum()
    root = w.sqrt()
    xc, yc = (x - mu) * root, (y - y_mean) * root  # weighted least squares as plain least squares
    # (at most one direction per row: a few pooled images have fewer rows than features)
    rank = min(proj.linear_1.out_features // 2, x.shape[1], x.shape[0])
    # top principal directions of the features: they are what the ± pairs of hidden units carry
    _, _, vh = torch.linalg.svd(xc, full_matrices=False)
    basis = vh[:rank].T  # (d, rank)
    z = xc @ basis
    gram = z.T @ z
    penalty = ridge * gram.diagonal().mean()
    coef = torch.linalg.solve(gram + penalty * torch.eye(rank, dtype=gram.dtype), z.T @ yc)  # (rank, out)
    r2 = 1 - ((z @ coef - yc).pow(2).sum() / yc.pow(2).sum()).item()
    # unweighted RMS of the principal coordinates over the fit's patches
    scale = 1.0 if hidden == "raw" else (((x - mu) @ basis).pow(2).mean().rsqrt().item())
    affine = AffineProjector(basis, mu, coef, y_mean, scale)
    affine.write_into(proj)
    info = {"r2": r2, "seconds": time.perf_counter() - start, "rank": rank, "target": target}
    return info | {"hidden_scale": scale}, affine


class AffineProjector(torch.nn.Module):
    """``((x - mu) @ basis) @ coef + bias``: the ridge map, with only ``coef`` and ``bias`` trainable.

    ``basis`` ``(d, rank)`` and ``mu`` ``(d,)`` are fixed buffers; ``coef`` is ``(rank, out)``.
    ``scale``: the MLP's hidden units carry ``scale`` times the principal coordinates (see module doc).
    """

    def __init__(
        self,
        basis: torch.Tensor,
        mu: torch.Tensor,
        coef: torch.Tensor,
        bias: torch.Tensor,
        scale: float | torch.Tensor = 1.0,
    ):
        super().__init__()
        if float(scale) <= 0:
            raise ValueError(f"scale must be > 0, got {float(scale)}")
        self.register_buffer("basis", basis.float().clone())
        self.register_buffer("mu", mu.float().clone())
        self.register_buffer("scale", torch.tensor(float(scale), dtype=torch.float64))
        self.coef = torch.nn.Parameter(coef.float().clone())
        self.bias = torch.nn.Parameter(bias.float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mu) @ self.basis) @ self.coef + self.bias

    @torch.no_grad()
    def write_into(self, mlp) -> None:
        """Write the map exactly into the 2-layer GELU MLP: ``linear_1`` holds ± copies of the basis
        (``gelu(z) - gelu(-z) = z``), ``linear_2`` the coefficients; spare hidden units are zero."""
        basis, mu = self.basis.double() * self.scale, self.mu.double()
        coef, rank = self.coef.double() / self.scale, self.basis.shape[1]
        w1 = torch.zeros(mlp.linear_1.weight.shape, dtype=torch.float64)
        b1 = torch.zeros(mlp.linear_1.out_features, dtype=torch.float64)
        w1[:rank], w1[rank : 2 * rank] = basis.T, -basis.T
        b1[:rank], b1[rank : 2 * rank] = -(basis.T @ mu), basis.T @ mu
        w2 = torch.zeros(mlp.linear_2.weight.shape, dtype=torch.float64)
        w2[:, :rank], w2[:, rank : 2 * rank] = coef.T, -coef.T
        dtype = mlp.linear_1.weight.dtype
        mlp.linear_1.weight.copy_(w1.to(dtype))
        mlp.linear_1.bias.copy_(b1.to(dtype))
        mlp.linear_2.weight.copy_(w2.to(dtype))
        mlp.linear_2.bias.copy_(self.bias.to(dtype))


def image_tokens(loaded) -> int:
    """How many tokens one image becomes in ``loaded``'s prompts (its patches)."""
    from PIL import Image

    inputs = loaded.processor(
        text=loaded.prompt_template("", 1), images=[Image.new("RGB", (64, 64))], return_tensors="pt"
    )
    return int((inputs["input_ids"] == loaded.image_token_id).sum())


def position_start(loaded, kind: str, alpha: float, state: dict | None, source: str) -> None:
    """Install the projector ``kind`` (:data:`POSITION_BIASES`) asks for and load ``state`` into it.

    ``state``: a checkpoint's projector tensors (named ``source`` in errors), or None to keep the
    model's current MLP (after a ridge fit). ``"thirds"``: a ``state`` without a bias starts it from
    geometry (:func:`thirds_bias` at ``alpha``), one with a bias continues it. ``"none"`` refuses a
    ``state`` holding a bias rather than drop it.
    """
    from vlkv.runtime.models.projector_position import POSITION_KEY, install

    if kind not in POSITION_BIASES:
        raise ValueError(f"position bias must be one of {list(POSITION_BIASES)}, got {kind!r}")
    proj = loaded.model.model.multi_modal_projector
    if kind == "none":
        if state is not None and POSITION_KEY in state:
            raise ValueError(f"{source} holds a position bias: pass --position-bias thirds to keep it")
        if state is not None:
            proj.load_state_dict(state)
        return
    mlp = {k: v.detach().clone() for k, v in proj.state_dict().items() if k != POSITION_KEY}
    start = {POSITION_KEY: thirds_bias(loaded, alpha, image_tokens(loaded))}
    install(loaded.model, mlp | start | (state or {}))
    loaded.model.model.multi_modal_projector.requires_grad_(False)  # the caller picks what trains


def order_start(loaded, kind: str, order: torch.Tensor | None, source: str) -> None:
    """Put the image-token order ``kind`` (:data:`~vlkv.runtime.models.projector_order.ORDERS`) into
    the model's current (plain) MLP, keeping its weights.

    ``order``: the ``token_order`` of the checkpoint the MLP came from (named ``source`` in errors), or
    None. A checkpoint's order must be the one asked for: a projector trained for one order is not
    silently run in another (a raster-order checkpoint may start a ``columns`` run, which is the
    point of comparing them; the reverse drops what the run learned and is refused).
    """
    from vlkv.runtime.models.projector_order import ORDER_KEY, order_for
    from vlkv.runtime.models.projector_position import install

    wanted = order_for(kind, image_tokens(loaded))
    if order is not None and (wanted is None or not torch.equal(order.to(wanted.dtype), wanted)):
        raise ValueError(f"{source} holds another image-token order than {kind!r}")
    if wanted is None:
        return
    proj = loaded.model.model.multi_modal_projector
    mlp = {k: v.detach().clone() for k, v in proj.state_dict().items() if k != ORDER_KEY}
    install(loaded.model, mlp | {ORDER_KEY: wanted})
    loaded.model.model.multi_modal_projector.requires_grad_(False)  # the caller picks what trains


def pool_start(loaded, pool: int, state: dict | None, source: str) -> dict | None:
    """Install the pooled projector ``pool`` asks for (:data:`~vlkv.runtime.models.projector_pool.POOLS`)
    with the model's current MLP weights, match the processor's image-token count to it, and return
    ``state`` (a checkpoint's projector tensors, named ``source`` in errors; or None) with the pool
    key as the installed projector needs it.

    Call before the ridge fit (which then fits per pooled token). A checkpoint pooled otherwise is
    refused; an unpooled one may start a pooled run (its MLP is per token: it reads block means).
    """
    from vlkv.runtime.models.projector_pool import POOL_KEY, POOLS, match_processor
    from vlkv.runtime.models.projector_position import install

    if pool not in POOLS:
        raise ValueError(f"pool must be one of {list(POOLS)}, got {pool}")
    held = None if state is None else state.get(POOL_KEY)
    if held is not None and int(held) != pool:
        raise ValueError(f"{source} is pooled by {int(held)}, not {pool}")
    if pool == 1:
        return state
    proj = loaded.model.model.multi_modal_projector
    mlp = {k: v.detach().clone() for k, v in proj.state_dict().items() if k != POOL_KEY}
    install(loaded.model, mlp | {POOL_KEY: torch.tensor(pool, dtype=torch.int64)})
    loaded.model.model.multi_modal_projector.requires_grad_(False)  # the caller picks what trains
    match_processor(loaded.processor, loaded.model)
    return None if state is None else state | {POOL_KEY: torch.tensor(pool, dtype=torch.int64)}
