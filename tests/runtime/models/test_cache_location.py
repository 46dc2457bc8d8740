"""The test session never touches the user's ``~/.cache/vlkv`` (tests/conftest.py redirects it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import vlkv
from tests.conftest import CACHE_ENVS, USER_CACHE, user_cache_changes, user_cache_snapshot
from vlkv.runtime.models import smollm2_llava


def test_every_cache_points_outside_the_user_cache():
    user = USER_CACHE.resolve()
    for env in CACHE_ENVS:
        assert os.environ.get(env), f"{env} is not set for the test session"
        assert not Path(os.environ[env]).resolve().is_relative_to(user), f"{env} is inside {user}"
    assert not smollm2_llava.default_cache_dir().resolve().is_relative_to(user)


def test_every_cache_in_the_code_follows_an_environment_variable():
    """A module that builds a path under ``~/.cache`` must let one of CACHE_ENVS move it."""
    package = Path(vlkv.__file__).parent
    for source in sorted(package.rglob("*.py")):
        text = source.read_text(encoding="utf-8")
        if '".cache"' in text or "'.cache'" in text or '"~/.cache' in text:
            envs = [env for env in CACHE_ENVS if env in text]
            assert envs, f"{source.relative_to(package)} writes under ~/.cache without {sorted(CACHE_ENVS)}"


def test_subprocesses_inherit_the_private_cache():
    code = "from vlkv.runtime.models.smollm2_llava import default_cache_dir as d; print(d())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()) == smollm2_llava.default_cache_dir()
    assert not Path(out.strip()).resolve().is_relative_to(USER_CACHE.resolve())


def test_user_cache_guard_sees_new_changed_and_removed_files(tmp_path):
    root = tmp_path / "vlkv"
    assert user_cache_snapshot(root) == {}
    (root / "onnx").mkdir(parents=True)
    (root / "onnx" / "a.onnx").write_bytes(b"x")
    before = user_cache_snapshot(root)
    assert user_cache_changes(before, user_cache_snapshot(root)) == []
    (root / "onnx" / "a.onnx").write_bytes(b"xy")
    (root / "smollm2-llava").mkdir()
    after = user_cache_snapshot(root)
    assert user_cache_changes(before, after) == ["onnx/a.onnx", "smollm2-llava"]
    (root / "onnx" / "a.onnx").unlink()
    assert "onnx/a.onnx" in user_cache_changes(before, user_cache_snapshot(root))
