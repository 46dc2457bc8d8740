"""A per-step drop's kept columns (``LayerEdit.index``) are built only where something reads them.

H2O's decode step drops one column per row; ``select_top`` hands the edit the dropped columns and
the cache's one-call drop (``kv.drops``) closes every layer's gaps from them alone. The kept columns,
``(B, H_kv, width - 1)`` int64 per layer (~20 MB a step at h2o 0.5 over 8k × 4), used to be built for
every layer and never read there. Now the edit is a :class:`DropOneEdit` whose ``index`` is built on
first read. What must hold: on the one-call path no index is built; where the tables are rebuilt
from it (the in-place rewrite off) it is; either way every step's logits and the whole cache (lengths,
tables, spares, pool bytes) equal those of edits built eagerly (the code before), bit for bit; and
the lazy index, where read, equals ``kept_but`` of the dropped columns.
"""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.evict_rows as evict_rows
import vlkv.runtime.kv.drops as drops
import vlkv.runtime.policies.base as base
from tests.runtime.test_fused_append import TEXTS
from tests.runtime.test_step_advance import _same
from vlkv.runtime.policies import make_policy
from vlkv.runtime.policies.base import DropOneEdit
from vlkv.runtime.policies.ranking import kept_but
from vlkv.runtime.prompt import Prompt


def _state(cache) -> list:
    """Every layer's lengths, live table columns, next order, spares; the pool's bytes."""
    out = []
    for la in cache.layers:
        n = la.max_length
        tables = [getattr(la, t)[:, :, :n].clone() for t in ("slots", "positions", "modality", "order")]
        tables += [s[:, :, :n].clone() for s in la.scores.values()]
        out.append((la.lengths.clone(), la.host_lengths(), tables, la.next_order.clone(), la.spares.count()))
    pool = cache.layers[0].pool
    return [out, pool.used_bytes(), pool.bytes_written]


def _run(engine, prompts, steps: int, monkeypatch, eager: bool) -> tuple[list, list, tuple[int, int]]:
    """``steps`` H2O@0.5 decode steps after its prefill: logits per step, the cache's state, and the
    kept-column tables built and the drop-one edits made (``eager``: every edit's built at once, as
    before)."""
    built = [0]

    def counted(last, s):
        built[0] += 1
        return kept_but(last, s)

    monkeypatch.setattr(base, "kept_but", counted)
    made = [0]
    init = DropOneEdit.__init__

    def made_one(self, *args):
        made[0] += 1
        init(self, *args)

    monkeypatch.setattr(DropOneEdit, "__init__", made_one)
    if eager:
        monkeypatch.setattr(DropOneEdit, "built_index", lambda self: self.index)
    else:
        monkeypatch.setattr(DropOneEdit, "built_index", lambda self: self._index)
    pol = make_policy("h2o", budget=0.5)
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, pol, cache)  # evicts to the budget: each decode step then drops one
    tokens, logits = out.logits.argmax(-1), []
    for step in range(steps):
        res = engine.decode(tokens, batch, pol, cache, step + 1)
        logits.append(res.logits)
        tokens = res.logits.argmax(-1)
    return logits, _state(cache), (built[0], made[0])


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize("fused", [True, False], ids=["one-call-drop", "tables-rebuilt"])
def test_the_kept_columns_are_built_only_where_read(name, fused, engines, images, monkeypatch):
    """``fused``: the one-call drop closes the gaps (nothing reads the index); else the in-place
    rewrite is off (``drops.IN_PLACE``): each layer's tables are rebuilt from its index."""
    if evict_rows.kernel() is None:
        pytest.fail("the evict-rows kernel did not build (is a C++ compiler installed?)")
    monkeypatch.setattr(drops, "IN_PLACE", fused)
    engine = engines[name]
    # equal lengths: every row drops one column each step (H2O's per-step eviction)
    prompts = [Prompt(TEXTS[0], [images[0]]), Prompt(TEXTS[0], [images[0]])]
    steps, layers = 5, engine.backend.num_layers
    lazy_logits, lazy_state, lazy_built = _run(engine, prompts, steps, monkeypatch, eager=False)
    eager_logits, eager_state, eager_built = _run(engine, prompts, steps, monkeypatch, eager=True)
    made = eager_built[1]
    assert made >= 2 * layers and lazy_built[1] == made  # a drop-one edit of every layer, most steps
    assert eager_built[0] == made  # every edit's index built (the code before)
    # the one-call drop reads none; rebuilt tables read each layer's
    assert lazy_built[0] == (0 if fused else made)
    for a, b in zip(lazy_logits, eager_logits):
        assert torch.equal(a, b)
    _same(lazy_state, eager_state)


def test_a_drop_one_edit_builds_kept_but_of_its_dropped_columns():
    g = torch.Generator().manual_seed(0)
    dropped = torch.randint(0, 9, (2, 3, 1), generator=g)
    edit = DropOneEdit(9, torch.tensor([8, 8]), [8, 8], dropped)
    assert edit.built_index() is None
    assert torch.equal(edit.index, kept_but(dropped, 9))
    assert edit.built_index() is edit.index  # built once
    with pytest.raises(ValueError, match=r"dropped must be \(B, H_kv, 1\)"):
        DropOneEdit(9, torch.tensor([7, 7]), None, dropped.expand(2, 3, 2))
    with pytest.raises(ValueError, match="kept: one count per sample"):
        DropOneEdit(9, torch.tensor([8, 8]), [8], dropped)
