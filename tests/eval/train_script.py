"""``scripts/train_projector.py`` loaded once as a module, and its tiny-LLaVA config, for the training tests."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_projector.py"
# a few seconds of training: 4 steps of 2 samples, a 3-image ridge initialisation, no evaluation
TINY = {"model": "tiny-llava", "steps": 4, "batch": 2, "init_images": 3, "eval_every": 0}


@functools.cache
def load():
    """The script as the module ``train_projector`` (registered: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("train_projector", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_cfg(tp, **kw):
    """``tp.TrainConfig`` of :data:`TINY` with ``kw`` over it."""
    return tp.TrainConfig(**TINY | kw)


def check_plain_starts_a_form_run(tp, tmp_path, form: dict, key: str, refused: str) -> None:
    """A plain (raster, unpooled) run's checkpoint starts a run of projector ``form`` (config fields) with
    its weights and the form's ``key`` added; that run resumes; its checkpoint cannot start a plain run
    (the ``ValueError`` matches ``refused``)."""
    import pytest
    import torch

    plain = tp.train(tiny_cfg(tp, steps=1), tmp_path / "plain", quiet=True)
    cfg = tiny_cfg(tp, **form, init_from=str(tmp_path / "plain" / tp.CHECKPOINT))
    tp.train(cfg, tmp_path / "c", stop_at=0, quiet=True)
    start = torch.load(tmp_path / "c" / tp.CHECKPOINT, weights_only=False)["projector"]
    assert set(start) == set(plain) | {key}
    for name, value in plain.items():
        torch.testing.assert_close(start[name], value, rtol=0, atol=0)
    tp.train(cfg, tmp_path / "c", resume=True, quiet=True)
    with pytest.raises(ValueError, match=refused):
        tp.train(tiny_cfg(tp, init_from=str(tmp_path / "c" / tp.CHECKPOINT)), tmp_path / "d", quiet=True)
