"""scripts/train_projector.py on the tiny LLaVA: the ridge initialisation is exact, and a run that is
stopped and resumed ends with the same projector as one that was not."""

from __future__ import annotations

import pytest
import torch

from tests.eval.train_script import tiny_cfg as _cfg


def test_resume_gives_the_same_weights(tp, tmp_path):
    cfg = _cfg(tp)
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    first = tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    assert torch.load(tmp_path / "b" / tp.CHECKPOINT, weights_only=False)["step"] == 2
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    assert any(not torch.equal(first[k], straight[k]) for k in straight)  # the last two steps did move it
    assert (tmp_path / "b" / tp.LOG).read_text().count('"step"') == 4


def test_resume_refuses_other_settings(tp, tmp_path):
    tp.train(_cfg(tp), tmp_path, stop_at=1, quiet=True)
    with pytest.raises(ValueError, match="other settings"):
        tp.train(_cfg(tp, lr=1e-3), tmp_path, resume=True, quiet=True)


def test_ridge_init_is_written_exactly_into_the_mlp(tp):
    """The MLP after initialisation is the affine ridge map: gelu(z) - gelu(-z) = z on the ± pairs."""
    cfg = _cfg(tp)
    loaded = tp.load(cfg.model)
    info, _ = tp.ridge_init(loaded, cfg.seed, cfg.init_images, cfg.ridge, cfg.init_target)
    proj = tp.projector(loaded)
    rank = info["rank"]
    x = torch.randn(5, proj.linear_1.in_features, dtype=torch.float64)
    w1, b1 = proj.linear_1.weight.double(), proj.linear_1.bias.double()
    w2, b2 = proj.linear_2.weight.double(), proj.linear_2.bias.double()
    affine = (x @ w1[:rank].T + b1[:rank]) @ w2[:, :rank].T + b2  # the - half cancels gelu(z) - z
    with torch.no_grad():
        out = proj.double()(x)
    torch.testing.assert_close(out, affine, rtol=1e-9, atol=1e-9)
    assert 0 < info["r2"] <= 1


def test_hidden_scale_changes_the_parametrisation_not_the_map(tp):
    """``unit`` scales the ± hidden units to unit RMS on the fit's features and ``linear_2`` back:
    the same affine map as ``raw``, to float64 rounding."""
    cfg = _cfg(tp)
    loaded = tp.load(cfg.model)
    proj = tp.projector(loaded)
    x = torch.randn(7, proj.linear_1.in_features)
    outs, infos = {}, {}
    for hidden in ("raw", "unit"):
        infos[hidden], _ = tp.ridge_init(loaded, cfg.seed, cfg.init_images, cfg.ridge, "global", hidden)
        with torch.no_grad():
            outs[hidden] = proj(x)
    # (the tiny tower's standardised features fill every direction, so its unit scale is ~1 too)
    assert infos["raw"]["hidden_scale"] == 1.0 and 0 < infos["unit"]["hidden_scale"] < float("inf")
    torch.testing.assert_close(outs["unit"], outs["raw"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="init_hidden must be one of"):
        _cfg(tp, init_hidden="other")


def test_export_writes_safetensors_with_its_checksum(tp, tmp_path):
    import hashlib

    from safetensors.torch import load_file

    tp.train(_cfg(tp, steps=1), tmp_path, quiet=True)
    dest = tmp_path / "proj.safetensors"
    digest = tp.export(tmp_path, dest)
    assert digest == hashlib.sha256(dest.read_bytes()).hexdigest()
    assert set(load_file(dest)) == {"linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"}


def test_bad_settings_are_one_line(tp, tmp_path, capsys):
    assert tp.main(["--out", str(tmp_path), "--steps", "0", "--model", "tiny-llava"]) == 2
    assert capsys.readouterr().err.strip() == "train_projector: steps must be >= 1, got 0"


def test_second_phase_starts_from_another_runs_projector(tp, tmp_path):
    first = tp.train(_cfg(tp, steps=1), tmp_path / "a", quiet=True)
    cfg = _cfg(tp, steps=1, mix="focused", init_from=str(tmp_path / "a" / tp.CHECKPOINT))
    tp.train(cfg, tmp_path / "b", stop_at=0, quiet=True)
    start = torch.load(tmp_path / "b" / tp.CHECKPOINT, weights_only=False)
    assert start["step"] == 0 and start["init"] == {"from": cfg.init_from}
    for key, value in first.items():
        torch.testing.assert_close(start["projector"][key], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="mix must be one of"):
        _cfg(tp, mix="other")
    # the exported file names the first phase by its run directory, never by a machine path
    from safetensors import safe_open

    tp.export(tmp_path / "b", tmp_path / "b.safetensors")
    with safe_open(tmp_path / "b.safetensors", "pt") as f:
        meta = tp.json.loads(f.metadata()["config"])
    assert meta["init_from"] == "a/" + tp.CHECKPOINT


def test_linear_form_resumes_and_stays_affine(tp, tmp_path):
    """The linear form trains only the ridge map's coefficients: the saved MLP is that affine map
    exactly, and a stopped-and-resumed run ends on the same weights."""
    cfg = _cfg(tp, form="linear", mix="turns")
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    ckpt = torch.load(tmp_path / "a" / tp.CHECKPOINT, weights_only=False)
    a = ckpt["affine"]
    affine = tp.AffineProjector(a["basis"], a["mu"], a["coef"], a["bias"]).double()
    mlp = tp.projector(tp.load(cfg.model))
    mlp.load_state_dict(straight)
    x = torch.randn(5, a["basis"].shape[0], dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mlp.double()(x), affine(x), rtol=1e-5, atol=1e-5)
    init = torch.load(tmp_path / "a" / tp.CHECKPOINT, weights_only=False)["init"]
    assert not torch.equal(a["coef"], torch.zeros_like(a["coef"])) and "r2" in init


def test_follow_up_turns_are_supervised_answers_only(tp):
    """A sample with turns is one sequence: prompt, answer, next user turn, answer; only the answers
    (and their ends of turn) are marked for the loss."""
    from vlkv.eval.scene_tasks import Sample
    from vlkv.eval.scenes import make_scene

    loaded = tp.load("tiny-llava")
    tok = loaded.processor.tokenizer
    sample = Sample(
        (make_scene(["red circle"]),), "What is in the image?", "red circle", "x", (("Q2?", "left"),)
    )
    inputs, n_prompt = tp.encode(loaded, sample)
    mask = inputs["answer_mask"]
    assert mask.shape[0] == inputs["input_ids"].shape[1] and not mask[:n_prompt].any()
    marked = tok.decode(inputs["input_ids"][0][mask])
    assert marked.replace(tok.eos_token, "|") == "red circle|left|"
    assert "Q2?" in tok.decode(inputs["input_ids"][0][n_prompt:][~mask[n_prompt:]])
    assert tp.sample_loss(loaded, sample).isfinite()


def test_local_patches_lie_on_their_objects():
    """smollm2-llava's geometry (256 shortest edge, 224 crop, 16x16 patches): each object owns the
    patches around its centre, left object first; the rest is background."""
    from types import SimpleNamespace

    import numpy as np

    from vlkv.eval.projector_init import patch_objects
    from vlkv.eval.scenes import random_scene

    proc = SimpleNamespace(
        do_resize=True,
        size=SimpleNamespace(shortest_edge=256),
        do_center_crop=True,
        crop_size=SimpleNamespace(height=224),
    )
    scene = random_scene(np.random.default_rng(4), "train", 2)
    owner = patch_objects(scene, proc, 16).reshape(16, 16)
    for i, obj in enumerate(scene.objects):
        # the scene pixel (cx, cy) lands at (c * 256 / 224 - 16) / 14 in patches
        row, col = ((np.array([obj.cy, obj.cx]) * 256 / 224 - 16) // 14).astype(int)
        assert owner[row, col] == i
        area = (owner == i).sum()
        expected = np.pi * (obj.radius * 256 / 224 / 14) ** 2
        assert 0.5 * expected < area < 3 * expected
    assert (owner == -1).mean() > 0.6
    cols = [np.nonzero(owner == i)[1].mean() for i in range(2)]
    assert cols[0] < cols[1]


def test_local_init_fits_and_trains(tp, tmp_path):
    cfg = _cfg(tp, init_target="local", init_images=4, steps=1, mix="mixed")
    tp.train(cfg, tmp_path, quiet=True)
    init = tp.json.loads((tmp_path / tp.LOG).read_text().splitlines()[0])
    assert init["target"] == "local" and 0 < init["r2"] <= 1
    with pytest.raises(ValueError, match="init_target must be one of"):
        _cfg(tp, init_target="other")


def test_local_pos_targets_say_where_in_words(tp):
    """``local-pos``: an object's patches -> the mean of its colour, shape and position word targets
    (the same pair left and right gets two targets); background patches -> "background"; ``local``
    keeps colour + shape only."""
    import numpy as np

    from vlkv.eval.projector_init import BACKGROUND, patch_targets, word_target
    from vlkv.eval.scenes import make_scene

    loaded = tp.load("tiny-llava")
    scene = make_scene(["red circle", "red circle"])
    assert [o.position for o in scene.objects] == ["left", "right"]
    owner = np.array([-1, 0, 1, 0, -1])
    words = {w: word_target(loaded, w, False) for w in ("red", "left", "right", BACKGROUND)}
    circle = word_target(loaded, "circle", True)
    pos = patch_targets(loaded, scene, owner, "local-pos")
    assert pos.shape == (5, words["red"].shape[0])
    torch.testing.assert_close(pos[1], (words["red"] + circle + words["left"]) / 3)
    torch.testing.assert_close(pos[2], (words["red"] + circle + words["right"]) / 3)
    torch.testing.assert_close(pos[3], pos[1])
    torch.testing.assert_close(pos[0], words[BACKGROUND])
    plain = patch_targets(loaded, scene, owner, "local")
    torch.testing.assert_close(plain[1], (words["red"] + circle) / 2)
    torch.testing.assert_close(plain[2], plain[1])  # without the position word, left = right
    with pytest.raises(ValueError, match="local or local-pos"):
        patch_targets(loaded, scene, owner, "global")


def test_local_pos_init_fits_and_trains(tp, tmp_path):
    tp.train(_cfg(tp, init_target="local-pos", init_images=4, steps=1, mix="mixed"), tmp_path, quiet=True)
    init = tp.json.loads((tmp_path / tp.LOG).read_text().splitlines()[0])
    assert init["target"] == "local-pos" and 0 < init["r2"] <= 1


def test_labels_reach_several_picture_training_prompts(tp, tmp_path):
    """``labels="ordinal"`` puts "The k-th picture:" before each image of a several-picture sample's
    prompt (a one-picture prompt is unchanged), and a run trains with it."""
    from vlkv.eval.scene_tasks import Sample
    from vlkv.eval.scenes import make_scene

    loaded = tp.load("tiny-llava")
    tok = loaded.processor.tokenizer
    two = Sample((make_scene(["red circle"]), make_scene(["blue star"])), "Q?", "red", "x")
    one = Sample((make_scene(["red circle"]),), "Q?", "red", "x")
    plain, n_plain = tp.encode(loaded, two)
    labelled, n_labelled = tp.encode(loaded, two, labels="ordinal")
    assert "The second picture:" in tok.decode(labelled["input_ids"][0][:n_labelled])
    assert n_labelled > n_plain and "picture" not in tok.decode(plain["input_ids"][0][:n_plain])
    assert torch.equal(
        tp.encode(loaded, one, labels="ordinal")[0]["input_ids"], tp.encode(loaded, one)[0]["input_ids"]
    )
    tp.train(_cfg(tp, steps=1, mix="mixed-nth", labels="ordinal"), tmp_path, quiet=True)
    with pytest.raises(ValueError, match="labels must be one of"):
        _cfg(tp, labels="roman")


def test_anchor_pulls_toward_the_start_and_resumes(tp, tmp_path):
    """``anchor`` adds ``anchor * sum |W - W0|^2 / |W0|^2`` to the loss: zero at the start, logged each
    step, the start kept in the checkpoint (a resumed run matches), and the weights drift less."""
    w0 = [torch.ones(3), torch.full((2, 2), 2.0)]
    moved = [torch.full((3,), 1.5), torch.full((2, 2), 2.0)]
    assert tp.anchor_penalty(w0, w0).item() == 0
    torch.testing.assert_close(tp.anchor_penalty(moved, w0), torch.tensor(0.75 / 3))
    free = tp.train(_cfg(tp, mix="long", lr=3e-3), tmp_path / "free", quiet=True)
    cfg = _cfg(tp, mix="long", lr=3e-3, anchor=1e3)
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    ckpt = torch.load(tmp_path / "a" / tp.CHECKPOINT, weights_only=False)
    start = dict(zip(straight, ckpt["anchor_to"]))  # the MLP's parameters, in state-dict order
    log = (tmp_path / "a" / tp.LOG).read_text().splitlines()
    assert '"anchor": 0.0,' in log[1] and '"anchor"' in log[-1]

    def drift(weights):
        return sum(((weights[k] - start[k]).norm() / start[k].norm()).item() for k in start)

    assert drift(straight) < drift(free)
    with pytest.raises(ValueError, match="anchor must be >= 0"):
        _cfg(tp, anchor=-1.0)


def _smollm2_geometry():
    from types import SimpleNamespace

    return SimpleNamespace(
        do_resize=True,
        size=SimpleNamespace(shortest_edge=256),
        do_center_crop=True,
        crop_size=SimpleNamespace(height=224),
    )


def test_thirds_columns_follow_the_scenes_positions():
    """smollm2-llava's 16 patch columns: 5 left, 6 middle, 5 right; an object's centre column names
    the object's own position, except within half a patch of a third's border."""
    import numpy as np

    from vlkv.eval.projector_init import column_positions, patch_centres
    from vlkv.eval.scenes import SIZE, random_scene

    cols = column_positions(_smollm2_geometry(), 16)
    assert cols == ["left"] * 5 + ["middle"] * 6 + ["right"] * 5
    centres, half = patch_centres(_smollm2_geometry(), 16)
    rng, checked = np.random.default_rng(11), 0
    for _ in range(60):
        for obj in random_scene(rng, "train", 2).objects:
            if min(abs(obj.cx - SIZE / 3), abs(obj.cx - 2 * SIZE / 3)) < half:
                continue
            assert cols[int(np.abs(centres - obj.cx).argmin())] == obj.position
            checked += 1
    assert checked > 80


def test_thirds_bias_puts_each_columns_word_on_it(tp):
    """Patch p (row-major) starts at alpha x the input embedding of its column's position word."""
    from vlkv.eval.projector_init import column_positions, thirds_bias, word_target

    loaded = tp.load("tiny-llava")
    grid = 4  # tiny-llava: 56 px, patch 14
    bias = thirds_bias(loaded, 0.3, grid * grid)
    cols = column_positions(loaded.processor.image_processor, grid)
    assert set(cols) == {"left", "middle", "right"}
    for p in range(grid * grid):
        torch.testing.assert_close(bias[p], 0.3 * word_target(loaded, cols[p % grid], False), rtol=0, atol=0)
    with pytest.raises(ValueError, match="square grid"):
        thirds_bias(loaded, 0.3, 15)


def test_position_bias_run_resumes_and_exports_it(tp, tmp_path):
    """A ``thirds`` run from the ridge fit: the bias starts from geometry, trains, is in the
    checkpoint (a stopped-and-resumed run matches bit for bit) and in the exported file."""
    from safetensors.torch import load_file

    from vlkv.eval.projector_init import thirds_bias
    from vlkv.runtime.models.projector_position import POSITION_KEY

    cfg = _cfg(tp, position_bias="thirds", position_alpha=0.5)
    tp.train(cfg, tmp_path / "a", stop_at=0, quiet=True)
    start = torch.load(tmp_path / "a" / tp.CHECKPOINT, weights_only=False)["projector"]
    torch.testing.assert_close(start[POSITION_KEY], thirds_bias(tp.load(cfg.model), 0.5, 16), rtol=0, atol=0)
    straight = tp.train(cfg, tmp_path / "a", resume=True, quiet=True)
    assert not torch.equal(straight[POSITION_KEY], start[POSITION_KEY])  # it trains
    tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    assert straight.keys() == resumed.keys() == start.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    torch.testing.assert_close(load_file(tmp_path / "a.safetensors")[POSITION_KEY], straight[POSITION_KEY])


def test_position_bias_continues_or_starts_on_another_runs_projector(tp, tmp_path):
    """From a plain run's checkpoint the MLP is kept and the bias starts from geometry; from a
    biased run's checkpoint the bias is kept; a plain run refuses a biased checkpoint."""
    from vlkv.eval.projector_init import thirds_bias
    from vlkv.runtime.models.projector_position import POSITION_KEY

    plain = tp.train(_cfg(tp, steps=1), tmp_path / "plain", quiet=True)
    cfg = _cfg(tp, position_bias="thirds", init_from=str(tmp_path / "plain" / tp.CHECKPOINT))
    tp.train(cfg, tmp_path / "b", stop_at=0, quiet=True)
    start = torch.load(tmp_path / "b" / tp.CHECKPOINT, weights_only=False)["projector"]
    for key, value in plain.items():
        torch.testing.assert_close(start[key], value, rtol=0, atol=0)
    torch.testing.assert_close(start[POSITION_KEY], thirds_bias(tp.load(cfg.model), 0.5, 16), rtol=0, atol=0)
    biased = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    again = _cfg(tp, position_bias="thirds", init_from=str(tmp_path / "b" / tp.CHECKPOINT))
    tp.train(again, tmp_path / "c", stop_at=0, quiet=True)
    kept = torch.load(tmp_path / "c" / tp.CHECKPOINT, weights_only=False)["projector"]
    torch.testing.assert_close(kept[POSITION_KEY], biased[POSITION_KEY], rtol=0, atol=0)
    refuse = _cfg(tp, init_from=str(tmp_path / "b" / tp.CHECKPOINT))
    with pytest.raises(ValueError, match="holds a position bias"):
        tp.train(refuse, tmp_path / "d", quiet=True)
    with pytest.raises(ValueError, match="position_bias must be one of"):
        _cfg(tp, position_bias="rows")
    with pytest.raises(ValueError, match="needs form mlp"):
        _cfg(tp, position_bias="thirds", form="linear")


def test_vqa_swaps_in_a_biased_projector(tp, tmp_path):
    """``python -m vlkv.eval.vqa --projector`` takes a biased file (or checkpoint) and installs it."""
    from vlkv.eval.vqa import _swap_projector
    from vlkv.runtime.models import smollm2_llava as S
    from vlkv.runtime.models.projector_position import PositionBiasedProjector

    tp.train(_cfg(tp, steps=1, position_bias="thirds"), tmp_path / "a", quiet=True)
    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    loaded = tp.load("tiny-llava")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "NUM_IMAGE_TOKENS", 16)
        _swap_projector(loaded, tmp_path / "a.safetensors")
    assert isinstance(loaded.model.model.multi_modal_projector, PositionBiasedProjector)


def test_position_lr_scale_moves_the_bias_faster_and_resumes(tp, tmp_path):
    """``position_lr_scale`` gives the bias its own learning rate: it moves further than at 1x in the
    same steps, the MLP's first step is the same, and a stopped-and-resumed run matches bit for bit."""
    from vlkv.runtime.models.projector_position import POSITION_KEY

    base = _cfg(tp, position_bias="thirds", steps=1)
    start = tp.train(base, tmp_path / "s", stop_at=0, quiet=True)
    slow = tp.train(base, tmp_path / "a", quiet=True)
    fast_cfg = _cfg(tp, position_bias="thirds", steps=1, position_lr_scale=30.0)
    fast = tp.train(fast_cfg, tmp_path / "b", quiet=True)
    moved = {
        name: (run[POSITION_KEY] - start[POSITION_KEY]).abs().max()
        for name, run in (("1x", slow), ("30x", fast))
    }
    assert moved["30x"] > 10 * moved["1x"] > 0
    torch.testing.assert_close(fast["linear_1.weight"], slow["linear_1.weight"], rtol=0, atol=0)
    cfg = _cfg(tp, position_bias="thirds", position_lr_scale=30.0)
    straight = tp.train(cfg, tmp_path / "c", quiet=True)
    tp.train(cfg, tmp_path / "d", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "d", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    with pytest.raises(ValueError, match="position_lr_scale must be > 0"):
        _cfg(tp, position_lr_scale=0.0)
