"""scripts/probe_vision_layers.py --two: the dual ridge probe predicts as the primal one does, its
strength is chosen on training rows only, and the two-object features come per object and stage."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "probe_vision_layers.py"


@pytest.fixture(scope="module")
def pv():
    spec = importlib.util.spec_from_file_location("probe_vision_layers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _primal(train_x, train_y, test_x, classes, ridge):
    mu, sd = train_x.mean(0), train_x.std(0) + 1e-6
    a, b = (train_x - mu) / sd, (test_x - mu) / sd
    w = np.linalg.solve(a.T @ a + ridge * np.eye(a.shape[1]), a.T @ np.eye(classes)[train_y])
    return (b @ w).argmax(1)


def test_dual_probe_predicts_as_the_primal_ridge(pv, monkeypatch):
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 6)) * 2
    train_y, test_y = rng.integers(3, size=60), rng.integers(3, size=20)
    train_x = centres[train_y] + rng.normal(size=(60, 6))
    test_x = centres[test_y] + rng.normal(size=(20, 6))
    for ridge in (1.0, 100.0):
        monkeypatch.setattr(pv, "RIDGES", (ridge,))
        guess, chosen = pv.probe_cv(train_x, train_y, test_x, 3)
        assert chosen == ridge
        np.testing.assert_array_equal(guess, _primal(train_x, train_y, test_x, 3, ridge))
    assert (guess == test_y).mean() > 0.8  # separable classes are found


def test_ridge_is_chosen_without_the_test_rows(pv):
    rng = np.random.default_rng(1)
    train_y = rng.integers(2, size=50)
    train_x = np.eye(2)[train_y] * 3 + rng.normal(size=(50, 2))
    test_x = rng.normal(size=(10, 2))
    # the test rows' content cannot change the chosen strength
    assert pv.probe_cv(train_x, train_y, test_x, 2)[1] == pv.probe_cv(train_x, train_y, test_x * 100, 2)[1]


def test_two_object_features_per_stage(pv):
    from vlkv.eval.scenes import COLOURS, SHAPES, random_scene
    from vlkv.runtime.models.registry import load_model

    loaded = load_model("tiny-llava")
    feats, labels = pv.two_features(loaded, "heldout", 3, seed=5, lm_layers=[0, 1])
    assert set(feats) == {key for key, _ in pv.STAGES + pv.lm_stages([0, 1])}
    assert labels.shape == (3, 2, 2)
    rng = np.random.default_rng([5, 23])
    for row in labels:  # the labels are the scenes' objects, left to right
        scene = random_scene(rng, "heldout", 2)
        want = [[list(COLOURS).index(o.colour), SHAPES.index(o.shape)] for o in scene.objects]
        np.testing.assert_array_equal(row, want)
    for key, value in feats.items():
        assert value.shape[0] == 3 and np.isfinite(value).all(), key
        assert value.ndim == (3 if key.endswith(("object", "answer")) else 2), key
    # the LM's layer 0 over the image tokens is the projector's output where the prompt put it
    np.testing.assert_allclose(feats["lm0_object"], feats["proj_object"], rtol=1e-5, atol=1e-5)
    assert not np.allclose(feats["lm1_object"], feats["lm0_object"])
    assert not np.allclose(feats["lm1_answer"][:, 0], feats["lm1_answer"][:, 1])  # left and right asked apart
    assert feats["patch_object"].shape[2] == feats["pooled_object"].shape[2]  # pooling keeps the width
