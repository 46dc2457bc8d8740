"""ONNX Runtime backend vs the PyTorch backend: step outputs, caches, greedy generations (A-VL's
core-only decode and prefill filter included), and the runtime's independence from the exporter."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.exporter.test_decoder_onnx import MODELS, onnx_cache  # noqa: F401 - shared export cache
from vlkv.runtime.backend import AttendIndex, StatsRequest, StepInputs
from vlkv.runtime.backends import BACKENDS
from vlkv.runtime.cache import Modality
from vlkv.runtime.edits import apply_edits
from vlkv.runtime.engine import Engine
from vlkv.runtime.ort_backend import OrtBackend
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


def _assert_caches_equal(a, b, tol=KV_TOL):
    assert torch.equal(a.lengths(), b.lengths())
    for la, lb in zip(a.layers, b.layers):
        (ka, va), (kb, vb) = la.attention_kv(), lb.attention_kv()
        for s in range(la.lengths.shape[0]):
            n = int(la.lengths[s])
            torch.testing.assert_close(ka[s, :, :n], kb[s, :, :n], **tol)
            torch.testing.assert_close(va[s, :, :n], vb[s, :, :n], **tol)
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
        kv_heads = layer.attention_kv()[0].shape[1]
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


def _decode_step(engine, cache, attend):
    b = cache.batch_size
    return StepInputs(
        torch.full((b, 1), 7), cache.next_position[:, None], torch.full((b, 1), int(Modality.GENERATED), dtype=torch.int8),
        torch.ones(b, dtype=torch.long), attend=attend,
    )  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_attend_indices_with_per_head_lengths_match_torch(name, engines, ort_engines, images):
    """A decode step over chosen past slots (different counts per sample and KV head): same logits,
    K/V, stats scattered back to slots, and attended counts as the PyTorch backend."""
    te, oe = engines[name], ort_engines[name]
    batch = te.encode(_prompts(images)[:2])
    caches = [te.new_cache(batch), oe.new_cache(batch)]
    prefill = StepInputs(
        batch.input_ids, batch.positions, batch.modality, batch.lengths, te.backend.embed(batch)
    )
    for be, c in zip((te.backend, oe.backend), caches):
        be.step(prefill, c)
    gen = torch.Generator().manual_seed(0)
    attend = []
    for layer in caches[0].layers:
        n, kv_heads = layer.lengths, layer.attention_kv()[0].shape[1]
        lens = torch.stack([torch.randint(1, int(m) + 1, (kv_heads,), generator=gen) for m in n])
        idx = torch.zeros(*lens.shape, int(lens.max()), dtype=torch.long)  # padding: any value
        for b, h in torch.cartesian_prod(torch.arange(lens.shape[0]), torch.arange(kv_heads)).tolist():
            pick = torch.randperm(int(n[b]), generator=gen)[: int(lens[b, h])]
            idx[b, h, : pick.numel()] = torch.sort(pick).values
        attend.append(AttendIndex(idx, lens))
    attend[1] = None  # one layer reads its whole cache
    request = StatsRequest(threshold=0.1)
    outs = [
        be.step(_decode_step(e, c, attend), c, request)
        for be, e, c in zip((te.backend, oe.backend), (te, oe), caches)
    ]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, **LOGITS_TOL)
    for i in range(4):
        _assert_stats_equal(outs[1].stats[i], outs[0].stats[i], f"attend layer {i}")
    torch.testing.assert_close(outs[1].attended, outs[0].attended)
    assert (outs[1].attended[0] < caches[1].lengths()[0]).all()  # really fewer entries than held
    _assert_caches_equal(*caches)


AVL = {"budget": 0.5, "core": 0.2, "interval": 3, "prefill_keep": 0.5, "filter_layer": 2}


@pytest.mark.parametrize("name", MODELS)
def test_avl_core_decode_and_prefill_filter_match_torch(name, engines, ort_engines, images):
    """A-VL as the paper runs it (core < secondary, prefill filter on): same greedy tokens, logits
    within 1e-4 at every step, same caches, and both plans really exercised."""
    te, oe = engines[name], ort_engines[name]
    prompts = _prompts(images)
    state = []
    for engine in (te, oe):
        policy = make_policy("avl", **AVL)
        batch = engine.encode(prompts)
        cache = engine.new_cache(batch)
        state.append([engine, policy, batch, cache, engine.prefill(batch, policy, cache)])
    torch.testing.assert_close(state[1][4].logits, state[0][4].logits, **LOGITS_TOL)
    _assert_caches_equal(state[0][3], state[1][3])
    # rows dropped: layers after the filter held (and computed statistics over) fewer slots
    widths = [st.colsum.shape[-1] for st in state[1][4].stats]
    assert widths == [st.colsum.shape[-1] for st in state[0][4].stats]
    assert max(widths[AVL["filter_layer"] :]) < min(widths[: AVL["filter_layer"]])
    core_steps = 0
    for step in range(1, NEW):
        tokens = [s[4].logits.argmax(-1) for s in state]
        assert torch.equal(tokens[0], tokens[1]), f"step {step}"
        for s, tok in zip(state, tokens):
            engine, policy, batch, cache, _ = s
            core_steps += policy.decode_attend(cache, engine.context(batch, step)) is not None
            s[4] = engine.decode(tok, batch, policy, cache, step)
        torch.testing.assert_close(state[1][4].logits, state[0][4].logits, **LOGITS_TOL, msg=f"step {step}")
        torch.testing.assert_close(state[1][4].attended, state[0][4].attended)
        # summation-order differences compound over the decode steps: the logits' tolerance
        _assert_caches_equal(state[0][3], state[1][3], LOGITS_TOL)
    assert core_steps > 0  # decode computed over the core only on non-refresh steps
    want = te.generate(prompts, make_policy("avl", **AVL), NEW, stop_at_eos=False)
    got = oe.generate(prompts, make_policy("avl", **AVL), NEW, stop_at_eos=False)
    assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
    assert got.extras == want.extras and got.extras["kv_used_fraction"] < got.extras["kv_stored_fraction"]


# ---------------------------------------------------------------- a damaged export cache is rebuilt
def _tamper_one_weight_byte(path: Path) -> None:
    """Raise the exponent byte of one float32 of the graph's largest initializer: same size, one byte."""
    import onnx

    data = bytearray(path.read_bytes())
    weight = max(onnx.load(str(path)).graph.initializer, key=lambda t: len(t.raw_data)).raw_data
    at = data.find(weight)
    assert at > 0 and data.count(weight[:64]) == 1
    data[at + 4 * 37 + 3] = 0x47  # little-endian float32: byte 3 holds the sign and exponent
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size


def _greedy(engine, images, policy="snapkv"):
    out = engine.generate(_prompts(images), make_policy(policy, budget=0.5), NEW, stop_at_eos=False)
    return [s.token_ids for s in out.samples]


def test_a_truncated_and_a_tampered_cache_file_are_rebuilt_before_use(
    loaded_models, engines, images, tmp_path, monkeypatch, caplog
):
    """Truncate one layer graph and change one byte of the head graph (same size): the next engine
    names the damaged cache file in one log line, re-exports, and generates PyTorch's greedy tokens."""
    from vlkv.runtime.onnx import export_cache

    monkeypatch.setenv(export_cache.CACHE_ENV, str(tmp_path / "cache"))
    loaded = loaded_models["tiny-llava"]
    want = _greedy(engines["tiny-llava"], images)
    entry = Engine(loaded, backend="onnxruntime").backend.model_dir
    assert entry.parent == tmp_path / "cache" and export_cache.verify(entry) is None
    pristine = {p.name: p.read_bytes() for p in entry.iterdir()}
    head, layer = entry / "head.onnx", entry / "layer.1.onnx"
    _tamper_one_weight_byte(head)
    with monkeypatch.context() as unchecked:  # what an unchecksummed cache ran: other tokens, no error
        unchecked.setattr(export_cache, "verify", lambda *a, **k: None)
        assert _greedy(Engine(loaded, backend="onnxruntime"), images) != want
    layer.write_bytes(pristine[layer.name][: len(pristine[layer.name]) // 2])
    with caplog.at_level(logging.WARNING):
        engine = Engine(loaded, backend="onnxruntime")
    assert engine.backend.model_dir == entry
    assert caplog.messages == [
        f"export cache file {head} fails its sha256 check (modified); rebuilding {entry}"
    ]
    assert _greedy(engine, images) == want
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == pristine
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # nothing left beside it


def test_vlkv_generate_on_a_damaged_cache_says_so_in_one_line_and_answers_like_torch(loaded_models, tmp_path):
    """``vlkv generate --backend onnxruntime`` after a same-size tamper and a truncation: exit 0, one
    line naming the cache file, the PyTorch backend's tokens; no traceback on this or later runs."""
    import json

    from vlkv.runtime.onnx.export_cache import CACHE_ENV

    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    loaded = loaded_models["tiny-llava"]  # the CLI's --model default, same seeded weights
    entry = OrtBackend(loaded.model, loaded.family, loaded.image_token_id, tmp_path / "cache").model_dir

    def generate(backend: str) -> tuple[list, list[str]]:
        cmd = [sys.executable, "-m", "vlkv.cli", "generate", "--backend", backend, "--max-new-tokens", "6"]
        out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        notes = [line for line in out.stderr.splitlines() if not line.startswith("-- ")]
        return [s["token_ids"] for s in json.loads(out.stdout)["samples"]], notes

    want, _ = generate("torch")
    _tamper_one_weight_byte(entry / "layer.0.onnx")
    (entry / "layer.3.onnx").write_bytes((entry / "layer.3.onnx").read_bytes()[:1000])
    got, notes = generate("onnxruntime")
    assert got == want
    assert notes == [
        f"export cache file {entry / 'layer.0.onnx'} fails its sha256 check (modified); rebuilding {entry}"
    ]
    assert generate("onnxruntime") == (want, [])


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` / ``from ... import`` in ``path`` names, at any depth (lazy ones too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_runtime_module_names_the_exporter():
    """Statically, lazy imports included: no module under ``vlkv/runtime`` imports ``vlkv.exporter``."""
    import vlkv.runtime

    root = Path(vlkv.runtime.__file__).parent
    offenders = {
        str(p.relative_to(root)): sorted(
            m for m in _imported_modules(p) if m.split(".")[:2] == ["vlkv", "exporter"]
        )
        for p in root.rglob("*.py")
    }
    assert {p: m for p, m in offenders.items() if m} == {}


def test_runtime_never_imports_the_exporter():
    """The runtime (ONNX Runtime backend included) stands below the exporter: importing and running
    its modules never loads ``vlkv.exporter``."""
    code = (
        "import sys\n"
        "import vlkv.runtime.ort_backend, vlkv.runtime.backends, vlkv.runtime.engine\n"
        "import vlkv.runtime.onnx.layer_graphs, vlkv.runtime.onnx.export_cache\n"
        "from vlkv.runtime.models.registry import load_model\n"
        "from vlkv.runtime.engine import Engine\n"
        "Engine(load_model('tiny-llava'), backend='onnxruntime')\n"
        "print(sorted(m for m in sys.modules if m.startswith('vlkv.exporter')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_bfloat16_models_are_refused_in_one_line(tmp_path):
    from vlkv.runtime.models.tiny import build_tiny_llava

    model, _ = build_tiny_llava(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 or float16 models, got torch.bfloat16"):
        OrtBackend(model, "llava", model.config.image_token_id, cache_dir=tmp_path)
