"""The device path's decoder layer (``device_layer``: fused q/k/v and gate/up GEMMs, the Triton glue under
the interpreter) against the HF layer, and a forced-Triton engine's tokens against transformers' generate."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from tests.conftest import TINY
from vlkv.plugins.ops import FORCE_TRITON_ENV
from vlkv.runtime.models import device_layer
from vlkv.runtime.models.registry import load_model
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

pytest.importorskip("triton", reason="the triton extra is part of vlkv[dev]")

MODELS = ("tiny-llava", "tiny-qwen2-vl")  # 1-D RoPE without biases; M-RoPE with q/k/v biases
# the largest difference from the HF layer, relative to the layer output's largest magnitude: the fused
# GEMMs and the norm's sum add in another order (fp32); a half dtype's roundings may fall apart (fp16: 4 ulps;
# bf16: 8, under the interpreter, whose fp32 -> bf16 cast truncates: ~1.5-2x the HF layer's own error against
# an fp32 layer, measured; fp16 there and every dtype on a GPU round to nearest)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3.2e-2}


def _backend(name: str, dtype: torch.dtype, monkeypatch):
    """A fresh tiny model (its weights get fused) in ``dtype`` behind a backend on the Triton path."""
    from vlkv.runtime.torch_backend import TorchBackend

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    loaded = load_model(name)
    loaded.model.to(dtype)
    return loaded, TorchBackend(loaded.model, loaded.family, loaded.image_token_id)


def _every_layer_matches(adapter, hidden, cos_sin):
    """Each decoder layer through the device layer equals the HF layer (its own weights) on ``hidden (B, S, E)``
    to ``TOL`` of the output's largest magnitude; each layer takes the HF layer's output of the last."""
    dtype = hidden.dtype
    with torch.no_grad():
        for layer in adapter.layers:
            fused = device_layer.prepared(layer, hidden, cos_sin[0])
            assert fused is not None
            got = device_layer.forward(fused, layer, hidden, None, cos_sin)
            want = adapter.run_layer(layer, hidden, None, cos_sin)
            assert got.dtype == dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=TOL[dtype] * want.abs().max().item())
            hidden = want


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("rows,q", [(4, 1), (1, 1), (2, 3)])
def test_device_layer_equals_the_hf_layer(name, dtype, rows, q, monkeypatch):
    _, be = _backend(name, dtype, monkeypatch)
    adapter = be.adapter
    assert adapter.device_layer
    torch.manual_seed(0)
    hidden = torch.randn(rows, q, adapter.text_config.hidden_size).to(dtype)
    pos = (torch.arange(q) + 5).expand(rows, q)[..., None].expand(rows, q, be.pos_dims)
    cos_sin = adapter.rotary(hidden, pos)
    _every_layer_matches(adapter, hidden, cos_sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_on_cuda_the_device_layer_equals_the_hf_layer(name, dtype, monkeypatch):
    """The kernels compiled for the GPU (no interpreter, round-to-nearest casts): the same tolerances."""
    from vlkv.runtime.torch_backend import TorchBackend

    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    loaded = load_model(name)
    loaded.model.to("cuda", dtype)
    be = TorchBackend(loaded.model, loaded.family, loaded.image_token_id)
    adapter = be.adapter
    assert adapter.device_layer
    torch.manual_seed(0)
    hidden = torch.randn(4, 1, adapter.text_config.hidden_size, device="cuda").to(dtype)
    pos = torch.full((4, 1, be.pos_dims), 7, device="cuda")
    cos_sin = adapter.rotary(hidden, pos)
    _every_layer_matches(adapter, hidden, cos_sin)


def test_weights_are_fused_in_place_and_a_replaced_module_is_not_taken(monkeypatch):
    _, be = _backend("tiny-llava", torch.float32, monkeypatch)
    layer = be.adapter.layers[0]
    attn = layer.self_attn
    fused = device_layer.fuse(layer)
    assert fused is layer.__dict__[device_layer.ATTR]  # built once, at the backend's start
    # the projections' parameters are rows of the one fused matrix: no second copy of the weights
    assert attn.q_proj.weight.data_ptr() == fused.qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused.qkv.t()[attn.q_proj.out_features :].data_ptr()
    hidden = torch.randn(2, 1, be.adapter.text_config.hidden_size)
    cos = be.adapter.rotary(hidden, torch.zeros(2, 1, 1, dtype=torch.long))[0]
    assert device_layer.prepared(layer, hidden, cos) is fused
    strided = torch.randn(2, 1, 2 * hidden.shape[-1])[..., ::2]
    assert device_layer.prepared(layer, strided, cos) is None  # rows the 2-D view cannot take
    attn.q_proj = nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)  # e.g. LoRA
    assert device_layer.prepared(layer, hidden, cos) is None


def test_the_device_layer_switch_and_other_devices_leave_the_weights(monkeypatch):
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    loaded = load_model("tiny-llava")
    assert not device_layer.prepare(loaded.model.model.language_model.layers, torch.device("cpu"))
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    monkeypatch.setattr(device_layer, "DEVICE_LAYER", False)
    assert not device_layer.prepare(loaded.model.model.language_model.layers, torch.device("cpu"))
    assert all(device_layer.ATTR not in la.__dict__ for la in loaded.model.model.language_model.layers)


@contextlib.contextmanager
def _torch_path(monkeypatch):
    """The reference path inside: no forced Triton (torch attention, statistics and append) and the HF
    layer (``VLKV_DEVICE_LAYER=0``); the forced-Triton path again after."""
    with monkeypatch.context() as m:
        m.delenv(FORCE_TRITON_ENV)
        m.setattr(device_layer, "DEVICE_LAYER", False)
        yield


def _prompts(images):
    return [
        Prompt("Describe the picture.", [images[0]]),
        Prompt("Write a short poem about caches."),
    ]


@pytest.mark.parametrize("name", MODELS)
def test_forced_triton_engine_full_cache_equals_hf_generate(name, reference_models, images, monkeypatch):
    from tests.runtime.test_parity import NEW, _hf_tokens
    from vlkv.runtime.engine import Engine

    assert name in TINY
    loaded, _ = _backend(name, torch.float32, monkeypatch)
    engine = Engine(loaded)
    assert engine.backend.adapter.device_layer
    prompts = _prompts(images)
    expected = [_hf_tokens(reference_models[name], p) for p in prompts]
    got = engine.generate(prompts, make_policy("full"), NEW, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == expected
    # a compress-once and a per-step policy take the same layer: the same tokens as the reference, the
    # same engine on the PyTorch path (the HF layer, torch attention and statistics: no interpreted kernel,
    # where the forced-Triton reference's attention was ~a quarter of this test's time)
    for policy in (make_policy("snapkv", budget=0.5), make_policy("h2o", budget=0.5)):
        fast = engine.generate(prompts, policy, NEW, stop_at_eos=False)
        with _torch_path(monkeypatch):
            ref = engine.generate(prompts, policy, NEW, stop_at_eos=False)
        assert [s.token_ids for s in fast.samples] == [s.token_ids for s in ref.samples], policy


# a compress-once, a per-step and a per-head-budget policy beside the full cache, two requests each
STREAM_SPECS = [
    ("full", {}),
    ("h2o", {"budget": 0.5}),
    ("snapkv", {"budget": 0.3}),
    ("kvzip", {"budget": 0.5}),
]


# one model: the stream's concerns (preemption, a cancel, mixed policies through the device append) do not
# depend on the model, and under the interpreter each model costs ~1 minute; Qwen2-VL's M-RoPE positions and
# q/k/v biases are the harder device-layer case (both models' layers and generate are checked above)
@pytest.mark.parametrize("name", ["tiny-qwen2-vl"])
def test_forced_triton_stream_equals_each_solo_run(name, images, monkeypatch):
    """A stream whose decode steps take the device layer and append equals each request run alone on the
    reference path (the PyTorch path, ``VLKV_DEVICE_LAYER=0``: the skinny layer, torch attention, the
    cache's own append), on a fixed pool with preemption and a cancel."""
    import tests.runtime.test_stream_mix as mix
    from tests.runtime.test_scheduler import sched_entry_bytes
    from vlkv.runtime import fused_append
    from vlkv.runtime.engine import Engine

    loaded, _ = _backend(name, torch.float32, monkeypatch)
    engine = Engine(loaded)
    taken = []
    append = fused_append.device_decode_append

    def counted(*args):
        got = append(*args)
        taken.append(got is not None)
        return got

    monkeypatch.setattr("vlkv.runtime.models.skinny_layer.device_decode_append", counted)
    by_rows, rows_append = [], fused_append._append_by_rows

    def rows_counted(*args):  # the one-launch append from the step's table rows (kv/step_tables)
        got = rows_append(*args)
        by_rows.append(got is None)  # None: a request with holes (kvzip), the read table built apart
        return got

    monkeypatch.setattr(fused_append, "_append_by_rows", rows_counted)
    monkeypatch.setattr(mix, "SPECS", STREAM_SPECS)
    stream = mix._stream(images)
    with _torch_path(monkeypatch):  # the solo runs on the reference path, the stream not
        monkeypatch.setattr(fused_append, "DEVICE_APPEND", False)
        solo = [
            engine.generate([p], make_policy(pol, **kw), m, stop_at_eos=False).samples[0].token_ids
            for p, pol, kw, m in stream
        ]
        monkeypatch.setattr(fused_append, "DEVICE_APPEND", True)
    assert not any(taken)  # the switch off: the cache's own append
    longest = max(int(engine.encode([p]).lengths[0]) for p, *_ in stream)
    # 6 first: it is the pool that preempts this mix (a run at 3 fits without preempting, ~30 s for nothing
    # under the interpreter); the others stay so that a change of the mix cannot turn preemption off quietly
    for third in (6, 16, 3):
        pool_bytes = sched_entry_bytes(engine) * (longest + 8) * (third + 1) // third
        sched, reqs, victim = mix._run_stream(engine, stream, pool_bytes)
        mix._check_against_solo(sched, reqs, victim, stream, solo)
        if sum(r.preemptions for r in reqs) > 0:
            break
    assert sum(r.preemptions for r in reqs) > 0, "no pool size made the stream preempt"
    assert sum(taken) > 0  # the scheduler's decode steps took the device append
    # most of them from the step's table rows, with and without holes
    assert len(by_rows) > sum(taken) // 2 and any(by_rows) and not all(by_rows), (len(by_rows), sum(taken))
