"""ONNX Runtime backend vs the PyTorch backend: step outputs, caches and greedy generations."""

from __future__ import annotations

import pytest
import torch

from tests.exporter.test_decoder_onnx import MODELS, onnx_cache  # noqa: F401 - shared export cache
from vlkv.runtime.backend import AttendIndex, StatsRequest, StepInputs
from vlkv.runtime.backends import BACKENDS
from vlkv.runtime.cache import Modality
from vlkv.runtime.engine import Engine, apply_edits
from vlkv.runtime.ort_backend import OrtBackend, UnsupportedStep
from vlkv.runtime.policies import LayerEdit, make_policy
from vlkv.runtime.prompt import Prompt

NEW = 8
# float32 on both sides; the graph's attention sums in a different order than SDPA
LOGITS_TOL = {"atol": 1e-4, "rtol": 1e-4}
KV_TOL = {"atol": 1e-5, "rtol": 1e-5}
STATS_TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="session")
def ort_engines(loaded_models, onnx_cache):  # noqa: F811
    return {name: Engine(loaded_models[name], backend="onnxruntime") for name in MODELS}


def _prompts(images):
    return [
        Prompt("Describe the picture.", [images[0]]),
        Prompt("What differs between these two?", [images[1], images[2]]),
        Prompt("Write a short poem about caches."),
    ]


def _assert_stats_equal(got, want, msg):
    assert (got is None) == (want is None), msg
    if want is None:
        return
    torch.testing.assert_close(got.colsum, want.colsum, **STATS_TOL, msg=msg)
    assert torch.equal(got.visible, want.visible), msg
    assert (got.below is None) == (want.below is None), msg
    if want.below is not None:
        assert torch.equal(got.below, want.below), msg


def _assert_caches_equal(a, b):
    assert torch.equal(a.lengths(), b.lengths())
    for la, lb in zip(a.layers, b.layers):
        for s in range(la.lengths.shape[0]):
            n = int(la.lengths[s])
            torch.testing.assert_close(la.keys[s, :, :n], lb.keys[s, :, :n], **KV_TOL)
            torch.testing.assert_close(la.values[s, :, :n], lb.values[s, :, :n], **KV_TOL)
            assert torch.equal(la.positions[s, :, :n], lb.positions[s, :, :n])
            assert torch.equal(la.modality[s, :, :n], lb.modality[s, :, :n])


def test_registry_lists_onnxruntime():
    assert set(BACKENDS) >= {"torch", "onnxruntime"}


@pytest.mark.parametrize("name", MODELS)
def test_steps_match_torch_on_uneven_per_layer_caches(name, engines, ort_engines, images):
    te, oe = engines[name], ort_engines[name]
    batch = te.encode(_prompts(images))
    caches = [te.new_cache(batch), oe.new_cache(batch)]
    post = torch.arange(batch.input_ids.shape[1])[None, :] >= 5
    request = StatsRequest(threshold=0.05, extra={"tail": StatsRequest(rows=post, threshold=0.2)})
    prefill = StepInputs(
        batch.input_ids, batch.positions, batch.modality, batch.lengths, te.backend.embed(batch)
    )
    outs = [be.step(prefill, c, request) for be, c in zip((te.backend, oe.backend), caches)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, **LOGITS_TOL)
    for i in range(4):
        _assert_stats_equal(outs[1].stats[i], outs[0].stats[i], f"prefill layer {i}")
        _assert_stats_equal(
            outs[1].stats.extra["tail"][i], outs[0].stats.extra["tail"][i], f"extra layer {i}"
        )
    _assert_caches_equal(*caches)

    # layer l keeps every (l + 2)-th entry (plus the last): four different lengths per sample
    edits = []
    for layer_idx, layer in enumerate(caches[0].layers):
        keep = [
            torch.unique(torch.cat([torch.arange(0, n, layer_idx + 2), torch.tensor([n - 1])]))
            for n in layer.lengths.tolist()
        ]
        width = max(k.numel() for k in keep)
        index = torch.stack([torch.cat([k, k.new_zeros(width - k.numel())]) for k in keep])
        kv_heads = layer.keys.shape[1]
        edits.append(
            LayerEdit(
                index[:, None].expand(-1, kv_heads, -1).contiguous(), torch.tensor([k.numel() for k in keep])
            )
        )
    for c in caches:
        apply_edits(c, edits, spare=2)
    lengths = caches[0].lengths()
    assert len({tuple(row) for row in lengths.tolist()}) == 4  # every layer holds a different count

    # a right-padded multi-row step over those caches, all logits, thresholded stats of chosen rows
    ids = torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0]])
    new_len = torch.tensor([3, 1, 2])
    pos = caches[0].next_position[:, None, :] + torch.arange(3)[None, :, None]
    step = StepInputs(
        ids, pos, torch.full((3, 3), int(Modality.GENERATED), dtype=torch.int8), new_len, all_logits=True
    )
    rows = torch.tensor([[True, False, True], [True, True, True], [False, True, True]])
    request = StatsRequest(rows=rows, threshold=0.1, layers=frozenset({0, 2}))
    outs = [be.step(step, c, request) for be, c in zip((te.backend, oe.backend), caches)]
    valid = torch.arange(3)[None, :] < new_len[:, None]
    torch.testing.assert_close(outs[1].logits[valid], outs[0].logits[valid], **LOGITS_TOL)
    for i in range(4):
        _assert_stats_equal(outs[1].stats[i], outs[0].stats[i], f"decode layer {i}")
    assert outs[1].stats[1] is None and outs[1].stats[0] is not None
    assert torch.equal(outs[1].attended, outs[0].attended)
    _assert_caches_equal(*caches)
    assert torch.equal(caches[0].processed, caches[1].processed)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    ("policy", "budget"),
    [("full", 1.0), ("elastic", 0.2), ("vlcache", 0.2)],
    ids=["full", "elastic-0.2", "vlcache-0.2"],
)
def test_greedy_generation_matches_torch(name, policy, budget, engines, ort_engines, images):
    te, oe = engines[name], ort_engines[name]
    want = te.generate(_prompts(images), make_policy(policy, budget=budget), NEW, stop_at_eos=False)
    got = oe.generate(_prompts(images), make_policy(policy, budget=budget), NEW, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    assert [s.kept_per_layer for s in got.samples] == [s.kept_per_layer for s in want.samples]
    assert got.kv_bytes_used == want.kv_bytes_used
    if budget < 1.0:
        assert got.kv_bytes_used < got.full_kv_bytes


def test_selected_attention_steps_are_refused(ort_engines):
    backend = ort_engines["tiny-llava"].backend
    cache = ort_engines["tiny-llava"].new_cache(ort_engines["tiny-llava"].encode([Prompt("hi")]))
    attend = [AttendIndex(torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, dtype=torch.long))] * 4
    step = StepInputs(
        torch.tensor([[3]]), torch.zeros(1, 1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int8),
        torch.ones(1, dtype=torch.long), attend=attend,
    )  # fmt: skip
    with pytest.raises(UnsupportedStep, match="attend indices; use --backend torch"):
        backend.step(step, cache)


def test_bfloat16_models_are_refused_in_one_line(tmp_path):
    from vlkv.runtime.models.tiny import build_tiny_llava

    model, _ = build_tiny_llava(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 or float16 models, got torch.bfloat16"):
        OrtBackend(model, "llava", model.config.image_token_id, cache_dir=tmp_path)
