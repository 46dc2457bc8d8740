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
