"""--route-loss (vlkv.eval.route_loss): the asked object's tokens from the scene's geometry, the hooked
rows' probabilities equal eager attention's, the loss reaches the adapters, W = 0 changes nothing, and
the setting is checked, saved and held on resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.eval.train_script import tiny_cfg
from vlkv.eval import route_loss as rl
from vlkv.eval.scene_tasks import COLOUR_OF, LEFT_OF, ON_THE, SHAPE_ON, WHAT, Sample, two
from vlkv.eval.scenes import SIZE, make_scene, random_scene
from vlkv.runtime.models import lm_lora

GEO = rl.Geometry(256, 224, 8)  # smollm2-llava: resize 256, crop 224, 8x8 pooled tokens


def _token_of(x: float, y: float, geo: rl.Geometry = GEO) -> int:
    """The token whose block holds scene pixel ``(x, y)``."""
    scale, off, block = geo.resize / SIZE, (geo.resize - geo.crop) / 2, geo.crop / geo.side
    return int((y * scale - off) // block) * geo.side + int((x * scale - off) // block)


def test_target_covers_the_asked_object_and_not_the_other():
    rng = np.random.default_rng(3)
    for _ in range(20):  # generated two-object scenes, as training draws them
        scene = random_scene(rng, "train", 2)
        masks = [rl.object_mask(o, GEO) for o in scene.objects]
        for i, obj in enumerate(scene.objects):
            target = rl.target_mask(scene, i, GEO)
            assert target[_token_of(obj.cx, obj.cy)]  # the object's centre
            assert not (target & masks[1 - i]).any()  # nothing of the other object
            assert 2 <= int(target.sum()) <= 12 and not (target & ~masks[i]).any()
            # every corner of the object's box lies in one of its tokens (shared ones may be dropped)
            for dx in (-obj.radius // 2, obj.radius // 2):
                assert masks[i][_token_of(obj.cx + dx, obj.cy)]


def test_the_asked_object_follows_the_question():
    scene = make_scene(["red star", "blue circle"])
    left, right = scene.objects
    assert rl.asked_object(scene, ON_THE.format(position="right")) == 1
    assert rl.asked_object(scene, SHAPE_ON.format(position="left")) == 0
    assert rl.asked_object(scene, LEFT_OF.format(name=right.name)) == 0
    assert rl.asked_object(scene, COLOUR_OF.format(shape="circle")) == 1
    assert rl.asked_object(scene, WHAT) == 0  # the caption's first word is the left object's
    assert rl.asked_object(make_scene(["red star"]), "What shape is it?") == 0
    assert rl.asked_object(make_scene(["red star", "red star"]), WHAT) is None  # a counting scene
    rng = np.random.default_rng(0)
    assert all(
        rl.asked_object(s.scenes[0], s.question) is not None for s in (two(rng, "train") for _ in range(20))
    )


@pytest.fixture(scope="module")
def loaded(tp):
    return tp.load("tiny-llava")


def _sample():
    scene = make_scene(["black hexagon", "red circle"])
    return Sample((scene,), ON_THE.format(position="right"), "red circle", "x", ((WHAT, scene.caption),))


def test_hook_rows_equal_eager_attention(tp, loaded):
    model = loaded.model
    sample = _sample()
    inputs, _ = tp.encode(loaded, sample)
    inputs = {k: v for k, v in inputs.items() if k not in ("answer_mask", "targets")}
    layers = tuple(range(len(model.model.language_model.layers)))
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            plain = model(**inputs, use_cache=False).logits
            with rl.Router(loaded, sample, layers) as router:
                out = model(**inputs, use_cache=False, output_attentions=True)
    finally:
        model.set_attn_implementation(before)
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)  # the hooks change nothing
    rows = [r.row for r in router.rows]
    assert len(rows) == 2  # the side question and the follow-up caption
    for layer in layers:
        eager = out.attentions[layer][0][:, rows].float()  # (H, R, T)
        torch.testing.assert_close(router.probs[layer], eager, rtol=1e-5, atol=1e-6)
    ratios = router.ratios()
    assert ratios.shape == (len(layers), 2) and ((ratios > 0) & (ratios < 1)).all()
    # "objects": the asked object's share of both objects' mass (the caption row asks the left one)
    mean = router.probs[1].mean(dim=0)
    for i, r in enumerate(router.rows):
        t, o = mean[i, r.target].sum(), mean[i, r.other].sum()
        torch.testing.assert_close(router.ratios(over="objects")[1, i], t / (t + o))
        torch.testing.assert_close(ratios[1, i], t / mean[i, r.image].sum())
    assert torch.equal(router.rows[0].other, router.rows[1].target)  # right asked, then left


def test_the_loss_reaches_the_adapters(tp):
    loaded = tp.load("tiny-llava")
    adapters = lm_lora.attach(loaded.model, 2, ("q_proj", "k_proj"), 4.0, 0)
    for p in adapters:
        p.requires_grad_(True)
        if p.shape[1] == 2:  # B starts at zero (then A gets no gradient): give it a value
            torch.nn.init.normal_(p, std=0.1)
    sample = _sample()
    inputs, _ = tp.encode(loaded, sample)
    inputs = {k: v for k, v in inputs.items() if k not in ("answer_mask", "targets")}
    with rl.Router(loaded, sample, (1, 3)) as router:
        loaded.model(**inputs, use_cache=False)
    loss = router.loss()
    assert loss.item() > 0 and 0 < router.ratio < 1
    loss.backward()
    mods = lm_lora.adapters(loaded.model)
    for layer in (0, 1, 3):  # the routed layers and one below them
        for name in ("q_proj", "k_proj"):
            assert mods[f"{layer}.{name}"].A.grad.abs().sum() > 0
    assert mods["2.k_proj"].A.grad.abs().sum() > 0  # layer 3's input depends on layer 2
    with rl.maybe(loaded, sample, "1", 0.0) as none:
        assert none is None


def test_weight_zero_is_todays_step_and_hooks_change_nothing(tp, tmp_path, monkeypatch):
    kw = {"mix": "two-multi", "lm_lora_rank": 2, "lm_lora_targets": "q_proj,k_proj", "steps": 2}
    today = tp.train(tiny_cfg(tp, **kw), tmp_path / "a", quiet=True)
    # the same run with every sample's Router hooked and its term added at weight 0
    routers = []

    def hooked_router(loaded, s, layers, w, swaps=(), over="image"):
        routers.append(rl.Router(loaded, s, (0, 2), swaps))
        return routers[-1]

    monkeypatch.setattr(rl, "maybe", hooked_router)
    hooked = tp.train(tiny_cfg(tp, route_loss=0.0, **kw), tmp_path / "b", quiet=True)
    monkeypatch.undo()
    assert sum(bool(r.rows) for r in routers) >= 1  # the hooks did record rows
    for key in today:
        torch.testing.assert_close(hooked[key], today[key], rtol=0, atol=0)

    def losses(run):
        text = (tmp_path / run / tp.LOG).read_text().splitlines()
        return [(r["loss"], r["lr"]) for r in map(json.loads, text) if "step" in r]

    assert losses("a") == losses("b") and len(losses("a")) == 2
    routed = tp.train(tiny_cfg(tp, route_loss=1.0, route_layers="1,3", **kw), tmp_path / "c", quiet=True)
    assert any(not torch.equal(routed[k], today[k]) for k in today)
    assert '"route": {"ratio"' in (tmp_path / "c" / tp.LOG).read_text()


def test_config_checks_saves_and_resume_refuses_another_weight(tp, tmp_path):
    bad_settings = (
        {"route_loss": -0.1},
        {"route_layers": ""},
        {"route_layers": "1,1"},
        {"route_layers": "a"},
    )
    for bad in bad_settings + ({"route_over": "other"},):
        with pytest.raises(ValueError, match="route"):
            tiny_cfg(tp, **bad)
    with pytest.raises(ValueError, match="the LM has 4 layers"):
        rl.parse_layers("4", 4)
    cfg = tiny_cfg(tp, steps=2, route_loss=0.5, route_layers="0,2")
    tp.train(cfg, tmp_path, stop_at=1, quiet=True)
    saved = torch.load(tmp_path / tp.CHECKPOINT, weights_only=False)["config"]
    assert (saved["route_loss"], saved["route_layers"]) == (0.5, "0,2")
    with pytest.raises(ValueError, match="other settings"):
        tp.train(tiny_cfg(tp, steps=2), tmp_path, resume=True, quiet=True)
    tp.train(cfg, tmp_path, resume=True, quiet=True)


def test_measure_reports_per_layer_shares(loaded):
    samples = rl.heldout_samples(3, 0, "train")
    assert all(rl.asked_object(s.scenes[0], s.question) is not None for s in samples)
    record = rl.measure(loaded, samples, (0, 3))
    assert record["rows"] == 3 and 0 < record["chance"] < 1
    for key in ("ratio", "other", "objects"):
        assert set(record[key]) == {0, 3} and all(0 < v < 1 for v in record[key].values())
    assert all(record["ratio"][k] + record["other"][k] <= 1 + 1e-6 for k in (0, 3))
