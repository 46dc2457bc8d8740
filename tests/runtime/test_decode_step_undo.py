"""``Engine.decode`` on a batch cache that fails in a layer above the first leaves the cache as it was.

Each layer of a decode step appends its new entries before attending (the fused C++ append-and-read, or
the Python append then the read); a failure in layer ``k > 0`` used to leave layers ``0..k-1`` one
entry longer than the others. Every decode append reserves its host half first
(``kv/reservation.reserve_decode_entries``) and ``Engine.decode`` runs the step under
``undone_on_failure``: the step's reservations are taken back, last first. What must hold after the
failed step, for every layer: lengths and host lengths, the live columns of every table, next
sequence indices, spares, the K/V at held slots, the pool's allocated slots per head, references,
used and written bytes equal their state before; the step then reruns and every step's logits equal
(bit for bit) those of a run that never failed. Fused path on and off (the Python append), a full
cache and per-head holes, H2O at 0.7 (decode evictions: recycled spares), a growable and a fixed pool.
"""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.paged_append as paged_append
import vlkv.runtime.models.skinny_layer as skinny_layer
from tests.runtime.test_fused_append import TEXTS, _full
from tests.runtime.test_fused_append_faults import Fault, _assert_same, _layer_state, _pool_state
from tests.runtime.test_holes import _holey
from tests.runtime.test_scheduler import sched_entry_bytes
from vlkv.runtime.kv.pool import KVPool
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.step_context import StepContext


class LayerFault:
    """Raises in decode layer ``layer`` while ``armed``, after that layer appended: ``"read"`` the
    Python path's attention read (``StepContext.attend``), ``"fused"`` right after the fused
    append-and-read returned, ``"kernel"`` inside the fused call (a width the kernel refuses after it
    wrote the rows: ``test_fused_append_faults.Fault``)."""

    def __init__(self, monkeypatch, layer: int, kind: str, pool_of):
        self.armed, self.hits = False, 0
        if kind == "kernel":
            self._fault = Fault(monkeypatch, pool_of, layer, "width")
            self._fault.armed = False
            return
        self._fault = None
        if kind == "read":
            real = StepContext.attend

            def attend(ctx, layer_idx, *args):
                out = real(ctx, layer_idx, *args)
                if self.armed and layer_idx == layer and getattr(ctx, "one_row", False):
                    self.hits += 1
                    raise RuntimeError("injected read fault")
                return out

            monkeypatch.setattr(StepContext, "attend", attend)
        else:
            real = skinny_layer.fused_decode_row

            def fused(ctx, layer_idx, *args):
                out = real(ctx, layer_idx, *args)
                if self.armed and layer_idx == layer and out is not None:
                    self.hits += 1
                    raise RuntimeError("injected fault after the fused append")
                return out

            monkeypatch.setattr(skinny_layer, "fused_decode_row", fused)

    def arm(self, on: bool) -> None:
        self.armed = on
        if self._fault is not None:
            self._fault.armed = on

    @property
    def count(self) -> int:
        return self.hits if self._fault is None else self._fault.hits


def _fixed_full(engine, prompts):
    """A full-cache prefill on a fixed pool with room for a few decode steps."""
    batch = engine.encode(prompts)
    pool = KVPool.with_bytes(engine.new_cache(batch).pool.spec, sched_entry_bytes(engine) * 2000)
    cache = engine.new_cache(batch, pool=pool)
    return batch, cache, engine.prefill(batch, make_policy("full"), cache)


@pytest.mark.parametrize(
    "fused,kind", [(True, "fused"), (True, "kernel"), (False, "read")], ids=["fused", "kernel", "python"]
)
@pytest.mark.parametrize("prepare", [_full, _holey, _fixed_full], ids=["full", "holes", "fixed-pool"])
@pytest.mark.parametrize("policy", [("full", {}), ("h2o", {"budget": 0.7})], ids=["full", "h2o"])
def test_a_failure_in_a_later_layer_undoes_the_whole_step(
    fused, kind, prepare, policy, engines, images, monkeypatch
):
    engine = engines["tiny-llava"]
    layers = engine.backend.num_layers
    k = layers // 2
    assert k > 0
    prompts = [Prompt(TEXTS[0], [images[0]]), Prompt(TEXTS[2]), Prompt(TEXTS[1], [images[1]])]  # ragged
    steps, bad = 4, 2
    monkeypatch.setattr(paged_append, "FUSED_APPEND", fused)

    def run(fault_at: int | None):
        batch, cache, out = prepare(engine, prompts)
        pool = cache.layers[0].pool
        fault = LayerFault(monkeypatch, k, kind, lambda: pool)
        pol = make_policy(policy[0], **policy[1])
        tokens, logits = out.logits.argmax(-1), []
        for step in range(steps):
            if step == fault_at:
                ids = [la.layer for la in cache.layers]
                before = [_layer_state(la) for la in cache.layers], _pool_state(pool, ids)
                counts = pool.used_bytes(), pool.bytes_written
                fault.arm(True)
                with pytest.raises(RuntimeError):
                    engine.decode(tokens, batch, pol, cache, step + 1)
                fault.arm(False)
                assert fault.count == 1
                after = [_layer_state(la) for la in cache.layers], _pool_state(pool, ids)
                assert (pool.used_bytes(), pool.bytes_written) == counts
                for i, (a, b) in enumerate(zip(before[0], after[0])):
                    _assert_same(a, b, f"layer {i}")
                _assert_same(before[1], after[1], "pool")
                assert all(la.step_log is None for la in cache.layers)
            res = engine.decode(tokens, batch, pol, cache, step + 1)
            logits.append(res.logits)
            tokens = res.logits.argmax(-1)
        return logits, cache

    failed, cache = run(bad)
    clean, _ = run(None)
    for a, b in zip(failed, clean):
        assert torch.equal(a, b)
    assert len(set(la.host_lengths()[0] for la in cache.layers)) == 1  # every layer as long as the others
