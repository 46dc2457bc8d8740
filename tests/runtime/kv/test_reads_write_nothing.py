"""Reading a cache writes nothing: every public property and query of a ``LayerKV``, a ``KVCache`` and
a scheduler's batch view leaves each of their tensors and tables as it was (same tensor, same
``_version`` counter, same data), in every state a cache passes through: after a prefill, an eviction
(with recycled and run spares held), a merge, decode appends continuing a run, per-head holes, linked
(pre-RoPE) entries and low-rank factors. Writes are explicit method calls only."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor

from vlkv.runtime.backend import StepInputs
from vlkv.runtime.cache import KVCache, LayerKV, Modality
from vlkv.runtime.kv.batch import CacheBatch, LayerBatch
from vlkv.runtime.kv.lowrank import factor
from vlkv.runtime.kv.rope import Rope
from vlkv.runtime.prompt import Prompt

B, H, D, P = 3, 2, 8, 1


def _walk(obj, path: str, out: dict, seen: set) -> None:
    """Every tensor and plain value reachable from ``obj`` through runtime KV objects."""
    if isinstance(obj, Tensor):
        data = obj.detach().clone()
        out[path] = (id(obj), obj._version, data)
        return
    if isinstance(obj, (int, float, bool, str, type(None), torch.device, torch.dtype)):
        out[path] = obj
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, seen)
    elif type(obj).__module__.startswith("vlkv.runtime") and not isinstance(obj, Rope):
        for k, v in vars(obj).items():
            _walk(v, f"{path}.{k}", out, seen)


def _state(*objs) -> dict:
    out: dict = {}
    seen: set = set()
    for i, o in enumerate(objs):
        _walk(o, f"obj{i}", out, seen)
    return out


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for path, a in before.items():
        b = after[path]
        if isinstance(a, tuple):  # (id, version, data)
            assert a[0] == b[0], f"{path}: replaced by another tensor"
            assert a[1] == b[1], f"{path}: written in place (version {a[1]} -> {b[1]})"
            assert torch.equal(a[2], b[2]) or torch.allclose(a[2], b[2], rtol=0, atol=0, equal_nan=True), path
        else:
            assert a == b, f"{path}: {a!r} -> {b!r}"


def _public_properties(obj) -> list[str]:
    names = []
    for name, member in inspect.getmembers(type(obj)):
        if not name.startswith("_") and isinstance(member, property):
            names.append(name)
    return names


def _read_everything(obj) -> int:
    """Read every public property of ``obj`` and call its read-only queries; returns how many."""
    reads = 0
    for name in _public_properties(obj):
        getattr(obj, name)
        reads += 1
    queries = {
        LayerKV: lambda x: [
            x.kv_bytes(),
            x.used_kv_bytes(),
            x.spare_bytes(),
            x.meta_bytes(),
            x.held_mask(),
            x.kept_entries(),
            x.valid_mask(),
            x.open_mask(x.capacity + 2),
            x.table(x.capacity + 2),
            x.attention_kv(),
            x.run_start(x.max_length),
        ],
        KVCache: lambda x: [
            x.lengths(),
            x.kept_entries(),
            x.kv_bytes(),
            x.spare_bytes(),
            x.used_kv_bytes(),
            x.meta_bytes(),
            x.full_kv_bytes(),
        ],
        LayerBatch: lambda x: [x.open_mask(x.max_length + 1), x.table(x.max_length), x.valid_mask()],
        CacheBatch: lambda x: [x.lengths()],
    }
    for cls, ask in queries.items():
        if isinstance(obj, cls):
            reads += len(ask(obj))
    return reads


def _check(*objs) -> None:
    before = _state(*objs)
    assert sum(isinstance(v, tuple) for v in before.values()) > 5  # the walk found the tables
    for obj in objs:
        assert _read_everything(obj) >= 3
    _assert_same(before, _state(*objs))


def _prefilled(lengths=(5, 2, 7), seed: int = 0) -> LayerKV:
    g = torch.Generator().manual_seed(seed)
    layer = LayerKV.empty(len(lengths), H, D, P, torch.float32, "cpu")
    q = max(lengths)
    layer.append(
        torch.randn(len(lengths), H, q, D, generator=g),
        torch.randn(len(lengths), H, q, D, generator=g),
        torch.randint(0, 50, (len(lengths), q, P), generator=g),
        torch.randint(0, 3, (len(lengths), q), generator=g).to(torch.int8),
        torch.tensor(lengths),
    )
    layer.ensure_score("s").uniform_(generator=g)
    return layer


def _one_row(layer, g: torch.Generator) -> None:
    b = layer.lengths.shape[0]
    layer.append(
        torch.randn(b, H, 1, D, generator=g),
        torch.randn(b, H, 1, D, generator=g),
        torch.zeros(b, 1, P, dtype=torch.long),
        torch.full((b, 1), int(Modality.GENERATED), dtype=torch.int8),
        torch.ones(b, dtype=torch.long),
    )


def test_reads_of_a_prefilled_layer_write_nothing():
    _check(_prefilled())


def test_reads_after_an_eviction_with_recycled_slots_write_nothing():
    layer = _prefilled((7, 7, 7))
    index = torch.tensor([0, 1, 3, 4, 6]).expand(B, H, 5)
    layer.select(index, torch.full((B,), 5), spare=2, recycle=True)
    assert layer.recycled is not None  # the dropped slots wait for the next appends
    _check(layer)
    _one_row(layer, torch.Generator().manual_seed(1))
    _check(layer)


def test_reads_after_a_merge_write_nothing():
    layer = _prefilled((6, 6, 6))
    index = torch.tensor([0, 2, 4]).expand(B, H, 3)
    assign = torch.tensor([0, 0, 1, 1, 2, 2]).expand(B, H, 6).contiguous()
    layer.merge(index, torch.full((B,), 3), assign, torch.full((B, H, 3), 2))
    _check(layer)


def test_reads_with_per_head_holes_write_nothing():
    layer = _prefilled((7, 7, 7))
    holes = torch.zeros(B, H, 7, dtype=torch.bool)
    holes[0, 1, 2] = holes[2, 0, 5] = True
    layer.select(torch.arange(7).expand(B, H, 7), torch.full((B,), 7), holes=holes)
    assert layer.holes is not None
    _check(layer)


def test_reads_of_run_decode_entries_and_their_batch_view_write_nothing():
    """One-sample caches whose decode appends continue their prompt's run of slots (the state that
    used to queue table writes until a getter flushed them), alone and through a batch view."""
    from vlkv.runtime.cache import private_pool

    g = torch.Generator().manual_seed(2)
    pool = private_pool(1, H, D, torch.float32, "cpu")
    rows = []
    for n in (4, 4, 4):
        layer = LayerKV(pool, 0, 1, P)
        layer.run_reserve = 8
        layer.append(
            torch.randn(1, H, n, D, generator=g),
            torch.randn(1, H, n, D, generator=g),
            torch.zeros(1, n, P, dtype=torch.long),
            torch.zeros(1, n, dtype=torch.int8),
            torch.tensor([n]),
        )
        rows.append(layer)
    view = LayerBatch(rows)
    for _ in range(3):
        _one_row(view, g)
    assert all(r.run_start(7) is not None and r.spare_ids.shape[1] == 5 for r in rows)
    _check(view, *rows)


@pytest.fixture
def prefilled_cache(engines, images):
    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("Describe the picture.", [images[0]]), Prompt("Hi there.", [])])
    cache = engine.new_cache(batch)
    inputs = StepInputs(
        batch.input_ids, batch.positions, batch.modality, batch.lengths, engine.backend.embed(batch)
    )
    engine.backend.step(inputs, cache)
    return cache


def test_reads_of_a_model_cache_write_nothing(prefilled_cache):
    cache: KVCache = prefilled_cache
    _check(cache, *cache.layers)
    # a scheduler's view of the same caches, one row per request
    view = CacheBatch([cache])
    _check(view, *view.layers)


def test_reads_with_linked_entries_and_low_rank_factors_write_nothing(prefilled_cache):
    cache: KVCache = prefilled_cache
    first, second = cache.layers[0], cache.layers[1]
    # linked (pre-RoPE) entries: sample 1 links three of sample 0's slots
    ids = first.slots[0, :, :3].clone()
    first.link(ids, torch.arange(40, 43)[:, None], torch.full((3,), int(Modality.IMAGE), dtype=torch.int8), 1)
    assert first.linked
    # low-rank factors of the image entries of another layer
    images = (second.modality == int(Modality.IMAGE)) & second.valid_mask()[:, None, :]
    factor(second, images, rank=4, exact=True)
    assert second.lowrank is not None and bool((second.slots < 0).any())
    _check(cache, *cache.layers)
