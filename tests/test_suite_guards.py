"""The suite's own guards (tests/conftest.py): subprocesses get the suite's cache, and the final check
counts only what this process wrote under ``~/.cache/vlkv``."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import USER_CACHE, _audit_user_cache


def test_a_subprocess_with_its_own_env_still_gets_the_suite_cache(tmp_path):
    names = ("VLKV_CACHE", "VLKV_MODEL_CACHE", "VLKV_ONNX_CACHE")
    code = f"import os; [print(os.environ.get(n)) for n in {names!r}]"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PATH": os.environ.get("PATH", "")}, capture_output=True, text=True
    ).stdout.split()
    assert out == [os.environ[n] for n in names]
    # one that names its own cache keeps it
    mine = {"PATH": os.environ.get("PATH", ""), "VLKV_CACHE": str(tmp_path / "elsewhere")}
    out = subprocess.run([sys.executable, "-c", code], env=mine, capture_output=True, text=True).stdout
    assert out.split()[0] == str(tmp_path / "elsewhere")


def test_the_write_audit_sees_writes_under_the_cache_only(tmp_path):
    root = str(tmp_path / "vlkv")
    writes: list[str] = []
    hook = _audit_user_cache(writes, root)
    hook("open", (f"{root}/models/a.bin", "rb", os.O_RDONLY))  # a read
    hook("open", (f"{root}-other/a.bin", "wb", os.O_WRONLY))  # a sibling, not inside
    hook("open", (str(tmp_path / "x"), "w", os.O_WRONLY))
    hook("exec", (None,))
    assert writes == []
    hook("open", (f"{root}/models/a.bin", "wb", os.O_WRONLY | os.O_CREAT))
    hook("open", (f"{root}/onnx/b", None, os.O_RDWR))  # os.open
    hook("os.rename", (str(tmp_path / "tmp"), f"{root}/c", -1, -1))
    hook("os.utime", (f"{root}/d", None, None, None))
    hook("shutil.rmtree", (root, None))
    hook("open", (3, "w", 0))  # a file descriptor: no path
    assert writes == ["open models/a.bin", "open onnx/b", "os.rename c", "os.utime d", "shutil.rmtree ."]
    assert os.path.isabs(str(USER_CACHE))


def test_only_a_gpu_only_run_leaves_the_triton_interpreter():
    from tests.conftest import _gpu_only_run

    assert _gpu_only_run(["pytest", "-m", "gpu", "tests/runtime/test_device.py"])
    assert _gpu_only_run(["pytest", "-mgpu"])
    assert not _gpu_only_run(["pytest", "-m", "not gpu"])
    assert not _gpu_only_run(["pytest", "tests/runtime/test_device.py", "-k", "gpu"])
