"""The trained projector shipped with smollm2-llava: checksum pinned in code, verified on every build,
a missing or damaged file is one line naming it (never a silent fall back to random weights), and the
file is package data so an installed vlkv has it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from vlkv.runtime.models import smollm2_llava as S
from vlkv.runtime.models.registry import ModelLoadError, load_model

ROOT = Path(__file__).resolve().parents[3]


def test_shipped_file_matches_the_pinned_checksum():
    assert S.PROJECTOR_FILE.is_file()
    assert S._sha256(S.PROJECTOR_FILE) == S.PROJECTOR_SHA256
    state = S.load_projector()
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "linear_1.weight": (576, 384),
        "linear_1.bias": (576,),
        "linear_2.weight": (576, 576),
        "linear_2.bias": (576,),
    }
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in state.values())


def test_weights_are_package_data():
    # (tomllib is 3.11+; vlkv supports 3.10) the package-data line for this package, read as a list
    line = re.search(r'^"vlkv.runtime.models" = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert line, "pyproject.toml has no package-data entry for vlkv.runtime.models"
    patterns = [p.strip().strip('"') for p in line.group(1).split(",")]
    rel = S.PROJECTOR_FILE.relative_to(ROOT / "vlkv" / "runtime" / "models")
    assert any(rel.match(p) for p in patterns)


def _damaged(tmp_path: Path) -> Path:
    data = bytearray(S.PROJECTOR_FILE.read_bytes())
    data[len(data) // 2] ^= 0x01
    path = tmp_path / "projector.safetensors"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("make", "what"), [(lambda p: p / "absent.safetensors", "is missing"), (_damaged, "is damaged")]
)
def test_missing_or_damaged_file_is_one_line_naming_it(tmp_path, monkeypatch, make, what):
    path = make(tmp_path)
    with pytest.raises(ValueError) as err:
        S.load_projector(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and what in message
    # build() checks it before anything else and never falls back to the random projector
    monkeypatch.setattr(S, "PROJECTOR_FILE", path)
    monkeypatch.setattr(S, "_build_base", lambda *a: pytest.fail("built without a verified projector"))
    with pytest.raises(ModelLoadError) as err:
        load_model("smollm2-llava")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "cannot build 'smollm2-llava'" in message


def test_wrong_tensors_are_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="holds \\['weight'\\]"):
        S.load_projector(path, sha256=S._sha256(path))


def test_random_projector_keeps_its_name(monkeypatch):
    """smollm2-llava-random builds the seeded projector and never reads the trained file."""
    from vlkv.runtime.models.tiny import build_tiny_llava

    with pytest.raises(ValueError, match="projector must be one of"):
        S.build(projector="other")
    seen = []

    def fake_build(dtype=torch.float32, projector="trained"):
        seen.append(projector)
        return build_tiny_llava(dtype=dtype)

    monkeypatch.setattr(S, "build", fake_build)
    assert load_model("smollm2-llava-random").name == "smollm2-llava-random"
    assert load_model("smollm2-llava").name == "smollm2-llava"
    assert seen == ["random", "trained"]


@pytest.mark.slow
@pytest.mark.demo
def test_built_model_carries_the_trained_projector():
    model, _ = S.build()
    state = S.load_projector()
    for key, value in model.model.multi_modal_projector.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    random_model, _ = S.build(projector="random")
    random_weight = random_model.model.multi_modal_projector.linear_2.weight
    assert not torch.equal(random_weight, state["linear_2.weight"])
    # both come from the one cache: it holds the seeded projector, the trained one is put in after
    for key, value in random_model.model.language_model.state_dict().items():
        torch.testing.assert_close(model.model.language_model.state_dict()[key], value, rtol=0, atol=0)
