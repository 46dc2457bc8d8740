"""Create (idempotently) the side virtualenv that runs NVIDIA kvpress next to vlkv.

kvpress pins ``transformers<5.3`` while vlkv needs transformers 5.x at its newest, so the two
cannot share one environment. This script builds ``.venvs/kvpress`` (gitignored) holding the
same torch as the main environment and a pinned kvpress; ``scripts/kvpress_adapter.py`` then
runs inside it as a subprocess and talks to vlkv through JSON and ``.pt`` files only.

Usage::

    python scripts/kvpress_env.py            # create or verify, print the venv's python
    python scripts/kvpress_env.py --check    # exit 1 (one line, no traceback) if missing
    python scripts/kvpress_env.py --force    # rebuild from scratch

Idempotence: a stamp file records the pins; a venv whose stamp matches and whose
``import kvpress`` succeeds is left alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO_ROOT / ".venvs" / "kvpress"
STAMP_NAME = "vlkv-kvpress-stamp.json"

# torch is pinned exactly: an unpinned or ranged torch makes pip fetch the registry's newest
# CUDA build (several GB). 2.13.0 resolves to the local CPU wheel through PIP_FIND_LINKS.
TORCH_PIN = "torch==2.13.0"
# Newest kvpress on the registry (0.5.5) requires transformers>=4.56,<5.3; 5.2.0 is the newest
# release inside that range, pinned so that results are reproducible across machines.
KVPRESS_PIN = "kvpress==0.5.5"
TRANSFORMERS_PIN = "transformers==5.2.0"
PINS = (TORCH_PIN, TRANSFORMERS_PIN, KVPRESS_PIN)


def venv_python(venv_dir: Path = DEFAULT_VENV) -> Path:
    """Path of the interpreter inside ``venv_dir`` (POSIX layout; Windows is not supported)."""
    return Path(venv_dir) / "bin" / "python"


def _stamp(venv_dir: Path) -> dict | None:
    path = Path(venv_dir) / STAMP_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def probe(venv_dir: Path = DEFAULT_VENV) -> dict | None:
    """Return ``{"kvpress": ver, "transformers": ver, "torch": ver}`` from inside the venv, or None."""
    py = venv_python(venv_dir)
    if not py.exists():
        return None
    code = (
        "import json, importlib.metadata as m, kvpress, torch, transformers;"
        "print(json.dumps({k: m.version(k) for k in ('kvpress', 'transformers', 'torch')}))"
    )
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def is_ready(venv_dir: Path = DEFAULT_VENV) -> bool:
    """True when the venv exists, its stamp matches :data:`PINS` and ``import kvpress`` works."""
    stamp = _stamp(venv_dir)
    return stamp is not None and stamp.get("pins") == list(PINS) and probe(venv_dir) is not None


def _pip(py: Path, *args: str) -> None:
    cmd = [str(py), "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def create(venv_dir: Path = DEFAULT_VENV, force: bool = False) -> Path:
    """Create or repair the venv; return its python. Raises CalledProcessError if pip fails."""
    venv_dir = Path(venv_dir)
    if force and venv_dir.exists():
        shutil.rmtree(venv_dir)
    if is_ready(venv_dir):
        return venv_python(venv_dir)
    if not venv_python(venv_dir).exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    py = venv_python(venv_dir)
    # torch first and alone, so kvpress's "torch<3" is already satisfied and pip never
    # considers the CUDA wheels; then the rest with torch repeated as a guard.
    _pip(py, TORCH_PIN)
    _pip(py, *PINS)
    versions = probe(venv_dir)
    if versions is None:
        raise RuntimeError(f"`import kvpress` still fails in {venv_dir}")
    (venv_dir / STAMP_NAME).write_text(json.dumps({"pins": list(PINS), "versions": versions}, indent=2))
    return py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="venv directory")
    parser.add_argument("--check", action="store_true", help="only report whether the venv is ready")
    parser.add_argument("--force", action="store_true", help="delete and rebuild the venv")
    args = parser.parse_args(argv)
    if args.check:
        if is_ready(args.venv):
            print(venv_python(args.venv))
            return 0
        print(f"kvpress venv not ready at {args.venv}; run `python scripts/kvpress_env.py`", file=sys.stderr)
        return 1
    try:
        py = create(args.venv, force=args.force)
    except (subprocess.CalledProcessError, RuntimeError) as exc:
        print(f"kvpress venv creation failed: {exc}", file=sys.stderr)
        return 1
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
