"""scripts/train_projector.py with the vision tower's last blocks trained (--vision-blocks) on the tiny
LLaVA: only the blocks before the read layer change, a stopped-and-resumed run ends bit for bit where
an uninterrupted one does, and the exported file carries the blocks back into a model through vqa's
--projector path."""

from __future__ import annotations

import pytest
import torch

from tests.eval.train_script import tiny_cfg
from vlkv.eval import vision_tune


def _tower(path):
    return torch.load(path, weights_only=False)["vision"]


def test_vision_blocks_train_resume_and_export(tp, tmp_path):
    from safetensors.torch import load_file

    from vlkv.eval.vqa import _swap_projector
    from vlkv.runtime.models import smollm2_llava as S

    cfg = tiny_cfg(tp, vision_blocks=1, vision_lr_scale=0.5)
    base = tp.load("tiny-llava")
    layer = vision_tune.read_layer(base.model)
    start = {k: v.detach().clone() for k, v in base.model.model.vision_tower.named_parameters()}
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    tower = _tower(tmp_path / "a" / tp.CHECKPOINT)
    block = f"{vision_tune._blocks(base.model.model.vision_tower)[0]}.{layer - 1}."  # the block before the read layer
    prefix = vision_tune.PREFIX + block
    assert tower and all(k.startswith(prefix) for k in tower)
    assert {k.removeprefix(vision_tune.PREFIX) for k in tower} == {k for k in start if k.startswith(block)}
    assert any((v - start[k.removeprefix(vision_tune.PREFIX)]).abs().max() > 0 for k, v in tower.items())

    tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    for key, value in _tower(tmp_path / "b" / tp.CHECKPOINT).items():
        torch.testing.assert_close(value, tower[key], rtol=0, atol=0)

    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    assert vision_tune.split(load_file(tmp_path / "a.safetensors"))[1].keys() == tower.keys()
    for path in (tmp_path / "a.safetensors", tmp_path / "a" / tp.CHECKPOINT):
        rebuilt = tp.load("tiny-llava")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(S, "NUM_IMAGE_TOKENS", 16)
            _swap_projector(rebuilt, path)
        got = dict(rebuilt.model.model.vision_tower.named_parameters())
        for key, value in tower.items():
            torch.testing.assert_close(got[key.removeprefix(vision_tune.PREFIX)], value, rtol=0, atol=0)
        # every other block is the frozen tower's
        for name, value in start.items():
            if not name.startswith(block):
                torch.testing.assert_close(got[name], value, rtol=0, atol=0)


def test_a_run_without_vision_blocks_writes_none(tp, tmp_path):
    tp.train(tiny_cfg(tp, steps=1), tmp_path / "a", quiet=True)
    assert "vision" not in torch.load(tmp_path / "a" / tp.CHECKPOINT, weights_only=False)


def test_bad_vision_settings_are_one_line(tp):
    with pytest.raises(ValueError, match="vision_blocks must be >= 0"):
        tiny_cfg(tp, vision_blocks=-1)
    with pytest.raises(ValueError, match="vision_lr_scale > 0"):
        tiny_cfg(tp, vision_lr_scale=0.0)
    model = tp.load("tiny-llava").model
    with pytest.raises(ValueError, match="vision blocks must be in 0"):
        vision_tune.tuned_blocks(model, vision_tune.read_layer(model) + 1)


def test_load_refuses_unknown_and_misshapen_tensors(tp):
    model = tp.load("tiny-llava").model
    name, param = next(iter(vision_tune.named_params(model, 1).items()))
    with pytest.raises(ValueError, match="not a vision tower parameter"):
        vision_tune.load(model, {vision_tune.PREFIX + "encoder.nope.weight": param.detach()})
    with pytest.raises(ValueError, match="has shape"):
        vision_tune.load(model, {name: torch.zeros(3)})
    vision_tune.load(model, {name: torch.ones_like(param)})
    assert torch.equal(vision_tune.named_params(model, 1)[name].detach(), torch.ones_like(param))
