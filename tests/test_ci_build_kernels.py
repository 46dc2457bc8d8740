"""``.ci/build_kernels.py``: it builds every C++ extension vlkv's runtime compiles, by the runtime's entry point."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("ci_build_kernels", ROOT / ".ci" / "build_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_extension_of_the_plugins_is_built_ahead():
    """A module of vlkv.plugins that compiles an extension and is missing from the list would build inside
    the tests again (a worker compiling, the other waiting): the list names each, and each has ``kernel()``."""
    callers = {
        path.stem
        for path in (ROOT / "vlkv" / "plugins").glob("*.py")
        if re.search(r"\bload_extension\(\s*\n?\s*_BUILT\b", path.read_text())
    }
    assert "skinny_gemm" in callers and "paged_cpu_kernel" in callers  # the search finds them
    kernels = _script().KERNELS
    assert sorted(kernels) == sorted(callers)
    for name in kernels:
        assert callable(importlib.import_module(f"vlkv.plugins.{name}").kernel), name
    # the scripts that compile their own extension, each run as a test does
    compiling = {p.stem for p in (ROOT / "scripts").glob("*.py") if "load_extension(" in p.read_text()}
    scripts = _script().SCRIPTS
    assert sorted(scripts) == sorted(compiling)
    for name, (path, *_) in scripts.items():
        assert (ROOT / path).stem == name


def test_a_build_runs_the_modules_own_entry_point(monkeypatch):
    """Each kernel builds in a new process through ``<module>.kernel()``; its exit code says if it built."""
    script = _script()
    seen = []

    class Done:
        returncode, stderr = 0, ""

    def run(cmd, **kwargs):
        seen.append(cmd)
        return Done()

    monkeypatch.setattr(script.subprocess, "run", run)
    name, code, secs, err = script.build("evict_rows")
    assert (name, code, err) == ("evict_rows", 0, "") and secs >= 0
    (cmd,) = seen
    assert cmd[0] == script.sys.executable and "evict_rows.kernel()" in cmd[-1]
    script.build("bench_gemm_stream")
    assert seen[-1][1] == str(ROOT / "scripts" / "bench_gemm_stream.py")
