"""The GPU check's ``compile`` part (``scripts/gpu_graph.py``) on the CPU: its timing loop over the full cache
and ``GRAPH_POLICIES`` runs end to end with the CUDA graph's capture replaced by a direct call (a graph needs
a GPU; the replay itself is ``test_cuda_graph.py``'s, on one) and the kernels under Triton's interpreter, so
a GPU run's minutes never go to a harness error."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_the_compile_part_times_every_graph_policy(monkeypatch):
    sys.path.insert(0, str(SCRIPTS))
    import gpu_graph

    from tests.conftest import make_image
    from vlkv.plugins.ops import FORCE_TRITON_ENV
    from vlkv.runtime import cuda_graph
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.registry import load_model
    from vlkv.runtime.prompt import Prompt

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")  # the device layers and the static step, interpreted
    monkeypatch.setattr(cuda_graph, "check_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")

    def capture(self, forward):
        outputs = forward()
        return SimpleNamespace(replay=lambda: [o.copy_(n) for o, n in zip(outputs, forward())]), outputs, ()

    monkeypatch.setattr(cuda_graph.DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(gpu_graph, "STEPS", 2)
    monkeypatch.setattr(gpu_graph, "BLOCKS", 1)
    import gpu_timing

    real_timed = gpu_timing.timed_ms
    monkeypatch.setattr(
        gpu_timing, "timed_ms", lambda fn, device, repeats: real_timed(fn, device, 1, warmup=0)
    )
    engine = Engine(load_model("tiny-llava"), decode_graph=True)
    one = engine.encode([Prompt("Describe the picture in a few words, please.", [make_image(0)])])
    sunk = []
    res = gpu_graph.time_policies(
        engine, one, 2, "cpu", sunk.append, {"model": "tiny-llava", "dtype": "fp32"}
    )
    assert sunk and sunk[-1] is res
    labels = [f"{n} {kw['budget']}" for n, kw in gpu_graph.GRAPH_POLICIES]
    assert list(res["policies"]) == labels
    for r in (res, *res["policies"].values()):
        # every timed graph step taken by the static step (none refused) and replayed
        assert r["taken"] == 1 + gpu_graph.STEPS * gpu_graph.BLOCKS and r["refused"] == {}, r
        assert r["captures"] >= 1 and r["replays"] == r["taken"]
        assert r["step_ms"]["eager"] > 0 and r["step_ms"]["graph"] > 0
    assert res["graph_vs_static_max_abs"] == 0.0  # the replay (here: the forward again) on the same buffers
    assert engine.backend.static.graphs.held == 0  # each policy's graphs dropped with its pool
    lines = "\n".join(gpu_graph.markdown(res))
    assert all(f"Scheduler.step(), {label}" in lines for label in labels)
