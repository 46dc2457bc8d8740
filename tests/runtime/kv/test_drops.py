"""A decode step's one-drop-per-row eviction of every layer by one C++ call (``kv.drops``,
``vlkv/plugins/evict_rows.py``) keeps exactly what the per-layer torch edit kept: the kernel against
:func:`~vlkv.runtime.kv.drops.shift_kept` on every table, refusals in one line, and H2O runs (batch
caches and scheduler requests, tiny LLaVA and tiny Qwen2-VL) with the kernel on and off: the same
tables, running scores, pool slots, spares and tokens at every step."""

from __future__ import annotations

import pytest
import torch

import vlkv.plugins.evict_rows as evict_rows
import vlkv.runtime.kv.drops as drops
from tests.runtime.kv.drop_tables import _dropped_columns, _kernel_built, _tables  # noqa: F401  (fixture)
from tests.runtime.policies.kept_sets import MODELS, kept_digests
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


@pytest.mark.parametrize("n", [1, 2, 9, 81, 729])
@pytest.mark.parametrize("where", ["anywhere", "first", "last"])
def test_drop_columns_equals_the_where_shift_on_every_table(n, where):
    """Every layer, table and column (the stale ones past ``k`` included) equals the per-layer
    ``where`` shift from the first dropped column; the dropped slots are the slot table's columns
    read before the move."""
    layers, b, h, cap = 3, 2, 3, n + 5
    cols = _dropped_columns(layers, b, h, n, where)
    fast, slow = _tables(layers, b, h, cap, n), _tables(layers, b, h, cap, n)
    want = torch.stack([t[0].gather(2, c[:, :, None])[:, :, 0] for t, c in zip(slow, cols)])
    index = torch.zeros(b, h, n - 1, dtype=torch.long)  # not read by the one-drop shift
    for tables, c in zip(slow, cols):
        drops.shift_kept(tables, index, int(c.min()), n - 1, c[:, :, None])
    gone = evict_rows.drop_columns(fast, cols, n - 1)
    assert torch.equal(gone, want)
    for f, s in zip(fast, slow):
        for a, e in zip(f, s):
            assert torch.equal(a, e)


def test_drop_columns_moves_strided_rows_and_refuses_bad_tables_in_one_line():
    """A table view whose rows are strided (a wider table's columns) moves only its rows; a dropped
    column outside ``[0, k]``, overlapping (broadcast) rows, a non-contiguous column, a first table
    that is not int64 slots and a layer count unlike ``cols`` are refused."""
    wide = _tables(2, 2, 3, 12, 1)
    view = [[t[:, :, :8] for t in group] for group in wide]
    copy = [[t.clone() for t in group] for group in view]
    cols = torch.tensor([[[0, 3, 5], [6, 6, 2]], [[1, 1, 1], [0, 4, 6]]])
    evict_rows.drop_columns(view, cols, 6)
    for group, c in zip(copy, cols):
        drops.shift_kept(group, torch.zeros(2, 3, 6, dtype=torch.long), int(c.min()), 6, c[:, :, None])
    for w, v in zip(wide, copy):
        for a, e in zip(w, v):
            assert torch.equal(a[:, :, :8], e)
    one = _tables(1, 2, 3, 8, 2)
    with pytest.raises(RuntimeError, match="a dropped column outside"):
        evict_rows.drop_columns(one, torch.full((1, 2, 3), 7), 6)
    bad = [[one[0][0], torch.zeros(1, 3, 8).expand(2, 3, 8)]]
    with pytest.raises(RuntimeError, match="rows must not overlap"):
        evict_rows.drop_columns(bad, torch.zeros(1, 2, 3, dtype=torch.long), 6)
    bad = [[one[0][0], torch.zeros(2, 3, 16)[:, :, ::2]]]
    with pytest.raises(RuntimeError, match="columns must be contiguous"):
        evict_rows.drop_columns(bad, torch.zeros(1, 2, 3, dtype=torch.long), 6)
    with pytest.raises(RuntimeError, match="int64 slot table"):
        evict_rows.drop_columns([one[0][1:]], torch.zeros(1, 2, 3, dtype=torch.long), 6)
    with pytest.raises(ValueError, match="1 layers of the same number"):
        evict_rows.drop_columns(_tables(2, 2, 3, 8, 3), torch.zeros(1, 2, 3, dtype=torch.long), 6)


def _state(cache) -> list[dict]:
    """Every layer's tables, scores, lengths and held spares (what a later step reads)."""
    out = []
    for layer in cache.layers:
        n = layer.max_length
        rec = layer.spares.recycled
        run = layer.spares.ids
        out.append(
            {
                "lengths": layer.lengths.tolist(),
                "tables": [t[:, :, :n].clone() for t in layer._entry_tables()],
                "recycled": None if rec is None else rec.clone(),
                "run": None if run is None else run.clone(),
            }
        )
    return out


def _same(a: list[dict], b: list[dict]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x["lengths"] == y["lengths"], i
        for t, u in zip(x["tables"], y["tables"], strict=True):
            assert torch.equal(t, u), i
        for key in ("recycled", "run"):
            assert (x[key] is None) == (y[key] is None), (i, key)
            assert x[key] is None or torch.equal(x[key], y[key]), (i, key)


def _count_fused(monkeypatch) -> list[int]:
    """Spy: layers whose gaps one kernel call closed, per call."""
    seen: list[int] = []
    real = evict_rows.drop_columns

    def spy(tables, cols, k):
        seen.append(len(tables))
        return real(tables, cols, k)

    monkeypatch.setattr(evict_rows, "drop_columns", spy)
    return seen


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_a_batch_cache_keeps_the_same_state_with_the_kernel_and_without(
    model, budget, engines, images, monkeypatch
):
    """Three rows in step, different images (different victims per row), 8 steps of H2O: after each
    step every layer's tables, running scores, lengths, recycled slots and the pool's free slots are
    equal with the kernel and with the per-layer torch edit, and so are the tokens."""
    engine = engines[model]
    prompts = [Prompt("Describe the picture.", [im]) for im in images]
    runs = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            m.setattr(evict_rows, "FUSED_DROP", fused)
            seen = _count_fused(m)
            policy, batch = make_policy("h2o", budget=budget), engine.encode(prompts)
            cache = engine.new_cache(batch)
            tokens, states = [], []
            with torch.no_grad():
                tok = engine.prefill(batch, policy, cache).logits.argmax(-1)
                for step in range(1, 9):
                    tok = engine.decode(tok, batch, policy, cache, step).logits.argmax(-1)
                    tokens.append(tok.tolist())
                    free = [cache.pool.free_slots(i) for i in range(len(cache.layers))]
                    states.append((_state(cache), free, cache.pool.bytes_written))
            cache.release()
            runs.append((tokens, states, list(seen)))
    (got_tok, got, seen), (want_tok, want, none) = runs
    assert len(seen) >= 4 and all(s == len(engine.new_cache(engine.encode(prompts[:1])).layers) for s in seen)
    assert not none
    assert got_tok == want_tok
    for step, ((g, *gp), (w, *wp)) in enumerate(zip(got, want, strict=True)):
        _same(g, w)
        assert gp == wp, step


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    "kw", [{"budget": 0.5}, {"budget": 0.3, "heavy_ratio": 0.8}, {"budget": 0.4, "evict_every": 3}]
)
def test_scheduler_requests_keep_the_same_sets_with_the_kernel_and_without(
    model, kw, engines, images, monkeypatch
):
    """One-sample caches under the scheduler (every prompt, 6 decode steps): the kept sets of every
    state of every layer and the tokens are equal with the kernel and without."""
    with monkeypatch.context() as m:
        seen = _count_fused(m)
        got = kept_digests(engines[model], "h2o", kw, images)
    assert seen, "no step took the kernel: the test would compare nothing"
    with monkeypatch.context() as m:
        m.setattr(evict_rows, "FUSED_DROP", False)
        want = kept_digests(engines[model], "h2o", kw, images)
    assert got == want


def _ranked_lowest(scores: torch.Tensor, valid: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
    """``rank_entries``' one-drop column: the stacked scores ranked (NaN and forced +inf, invalid
    -inf), then ``(S - 1) - flip.argmin``."""
    b, h, s = scores.shape
    ranked = scores.float().nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    ranked = ranked.masked_fill(~valid.expand(b, h, s), float("-inf"))
    if forced is not None:
        ranked = ranked.masked_fill(forced.expand(b, h, s) & valid.expand(b, h, s), float("inf"))
    return (s - 1) - ranked.flip(-1).argmin(-1, keepdim=True)


@pytest.mark.parametrize("s", [4, 9, 81, 729])
@pytest.mark.parametrize("per_head", [False, True])
def test_lowest_columns_equals_the_ranked_argmin(s, per_head):
    """Several layers' strided score views, ties (repeated values, -0.0 beside 0.0), NaN, ±inf,
    invalid columns and forced ones (per sample or per head): the same column as the stacked
    ranking's, per row."""
    from vlkv.runtime.policies.ranking import drop_one_each

    g = torch.Generator().manual_seed(s)
    b, h, layers = 3, 4, 5
    tables = [torch.randint(0, 6, (b, h, s + 7), generator=g).float() / 4 for _ in range(layers)]
    for t in tables:
        t[0, 0, : s // 2] = 0.0
        t[0, 0, 1::3] = -0.0
        t[1, 1, 2] = float("nan")
        t[1, 2, 0] = float("-inf")
        t[2, 3, -9] = float("inf")
    views = [t[:, :, :s] for t in tables]
    lengths = torch.tensor([s, s - 1, s - 3]).clamp(min=1)
    valid = (torch.arange(s)[None, :] < lengths[:, None])[:, None]
    forced = torch.rand(b, h if per_head else 1, s, generator=g) < 0.2
    for force in (None, forced):
        want = _ranked_lowest(
            torch.cat(views),
            valid.repeat(layers, 1, 1),
            None if force is None else force.repeat(layers, 1, 1),
        )
        got = evict_rows.lowest_columns(views, valid, force)
        assert torch.equal(got.view(layers * b, h, 1), want)
        assert torch.equal(drop_one_each(views, valid, force, [s - 1] * b), want)
    assert drop_one_each(views, valid, forced, [s - 2] * b) is None  # two drops: the stacked ranking's
    with pytest.raises(RuntimeError, match="unit column stride"):
        evict_rows.lowest_columns([torch.zeros(b, h, 2 * s)[:, :, ::2]], valid, None)


@pytest.mark.parametrize("s", [4, 9, 81, 729])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_ragged_rows_drop_the_column_each_row_drops_alone(s, kernel, monkeypatch):
    """Rows of different lengths (a scheduler cohort's requests, ``valid`` each row's prefix): each row's
    dropped column equals the one-drop ranking of the row's own columns alone — ties, -0.0, NaN, ±inf,
    forced columns, and rows whose every valid column ranks +inf (forced or NaN: the last valid column,
    not one past it); the C++ form and the torch form alike."""
    from vlkv.runtime.policies.ranking import drop_one_each

    monkeypatch.setattr(evict_rows, "FUSED_DROP", kernel)
    g = torch.Generator().manual_seed(s + 1)
    b, h, layers = 4, 3, 3
    tables = [torch.randint(0, 6, (b, h, s + 5), generator=g).float() / 4 for _ in range(layers)]
    lengths = [s, max(s - 1, 4), max(s // 2, 4), 4]
    for t in tables:
        t[0, 0, : s // 2] = 0.0
        t[1, 1, 1::3] = -0.0
        t[2, 2, 1] = float("nan")
        t[2, 0, 0] = float("-inf")
        t[1, 2, :] = float("nan")  # every valid column +inf
        t[3, :, :] = float("inf")
    views = [t[:, :, :s] for t in tables]
    n = torch.tensor(lengths)
    valid = (torch.arange(s)[None, :] < n[:, None])[:, None]
    forced = torch.rand(b, 1, s, generator=g) < 0.3
    forced[0, 0, :] = True  # row 0: every column forced
    for force in (None, forced):
        got = drop_one_each(views, valid, force, [k - 1 for k in lengths], lengths, per_row=True)
        for layer, view in enumerate(views):
            for row, m in enumerate(lengths):
                own = view[row : row + 1, :, :m]
                one = torch.ones(1, 1, m, dtype=torch.bool)
                want = _ranked_lowest(own, one, None if force is None else force[row : row + 1, :, :m])
                assert torch.equal(got[layer * b + row], want[0]), (layer, row)
    # a row keeping all it holds beside rows dropping one: only where the edits are split per row
    kept = [lengths[0], *[k - 1 for k in lengths[1:]]]
    assert drop_one_each(views, valid, forced, kept, lengths) is None
    assert drop_one_each(views, valid, forced, kept, lengths, per_row=True) is not None
    assert drop_one_each(views, valid, forced, [k - 2 for k in lengths], lengths, per_row=True) is None
    if len(set(lengths)) > 1:  # a batch cache's rows of different lengths: the stacked ranking's
        assert drop_one_each(views, valid, forced, [k - 1 for k in lengths], lengths) is None


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("s", [1, 7, 64, 4100])
def test_add_group_sums_equals_the_view_sum_add(group, s):
    """H2O's running attention by one call equals ``narrow(...).add_(view(...).sum(2))`` per layer bit
    for bit: softmax-like rows (a few large, many tiny, exact zeros), strided score tables and
    colsums that are views of the probabilities' ``(B, H_kv, G, W)`` layout."""
    g = torch.Generator().manual_seed(group * 10_000 + s)
    b, h, layers = 3, 5, 4
    wide = [torch.rand(b, h, s + 9, generator=g) * 3 for _ in range(layers)]
    scores = [t[:, :, : s + 4] for t in wide]  # strided rows
    probs = [torch.rand(b, h, group, s + 2, generator=g) ** 8 for _ in range(layers)]
    for p in probs:
        p[:, :, :, ::5] = 0.0
        p /= p.sum(-1, keepdim=True).clamp_min(1e-30)
    colsums = [p[..., :s].flatten(1, 2) for p in probs]
    want = [t.clone() for t in scores]
    for t, c in zip(want, colsums):
        t.narrow(2, 0, s).add_(c.view(b, h, group, s).sum(2))
    evict_rows.add_group_sums(scores, colsums, group)
    for t, w in zip(scores, want):
        assert torch.equal(t, w)
    with pytest.raises(RuntimeError, match="add_group_sums"):
        evict_rows.add_group_sums(scores[:1], [torch.zeros(b, h * group + 1, s)], group)


@pytest.mark.parametrize("model", MODELS)
def test_h2o_running_scores_equal_with_the_kernel_and_without(model, engines, images, monkeypatch):
    """A batch cache's H2O score tables after the prefill and after each of 6 decode steps: equal bit
    for bit with the one-call accumulation and eviction and with the per-layer torch ops."""
    engine = engines[model]
    prompts = [Prompt("Describe the picture.", [images[0]]), Prompt("What is in this image?", [images[1]])]
    runs = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            m.setattr(evict_rows, "FUSED_DROP", fused)
            policy, batch = make_policy("h2o", budget=0.5), engine.encode(prompts)
            cache = engine.new_cache(batch)
            got = []
            with torch.no_grad():
                tok = engine.prefill(batch, policy, cache).logits.argmax(-1)
                got.append([layer.scores["h2o"][:, :, : layer.max_length].clone() for layer in cache.layers])
                for step in range(1, 7):
                    tok = engine.decode(tok, batch, policy, cache, step).logits.argmax(-1)
                    got.append(
                        [layer.scores["h2o"][:, :, : layer.max_length].clone() for layer in cache.layers]
                    )
            cache.release()
            runs.append(got)
    for step, (a, b) in enumerate(zip(*runs, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), (step, i)


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("width", [0, 5, 64, 700])
def test_avl_text_step_equals_the_masked_update_and_the_counts(group, width):
    """A-VL's per-layer text bookkeeping by one call: the text scores (``+= group sum * (region ==
    text)`` over the held columns) bit for bit, and head 0's valid text counts, on ragged lengths with
    regions mixed per head."""
    g = torch.Generator().manual_seed(group * 1000 + width)
    b, h, layers, cap = 3, 5, 3, width + 6
    regions = [torch.randint(0, 3, (b, h, cap), generator=g).float() for _ in range(layers)]
    scores = [torch.rand(b, h, cap, generator=g) for _ in range(layers)]
    for t in scores:
        t[:, :, ::4] = -0.0  # torch's ``+= sum * 0`` makes a -0.0 score +0.0 (compared by bits below)
    probs = [torch.rand(b, h, group, width + 2, generator=g) ** 6 for _ in range(layers)]
    colsums = [p.flatten(1, 2) for p in probs]
    lengths = [torch.randint(0, width + 1, (b,), generator=g) for _ in range(layers)]
    want_scores = [t.clone() for t in scores]
    want_held = []
    for t, r, c, n in zip(want_scores, regions, colsums, lengths):
        is_text = r[:, :, :width] == 0
        t[:, :, :width] += c[:, :, :width].reshape(b, h, group, width).sum(2) * is_text
        valid = torch.arange(width)[None, :] < n[:, None]
        want_held.append((is_text[:, 0] & valid).sum(-1))
    held = evict_rows.avl_text_step(regions, scores, colsums, [width] * layers, lengths, group)
    assert torch.equal(held, torch.stack(want_held))
    for t, w in zip(scores, want_scores):
        assert torch.equal(t.view(torch.int32), w.view(torch.int32))  # bits: -0.0 is not +0.0
    with pytest.raises(RuntimeError, match="avl_text_step"):
        evict_rows.avl_text_step(regions, scores, colsums, [width + 3] * layers, lengths, group)


AVL_KW = [
    {"budget": 0.5, "core": 0.3, "text_min": 2},
    {"budget": 0.4, "interval": 1, "text": 0.3, "text_min": 0},
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kw", AVL_KW, ids=["core", "text0.3"])
def test_avl_keeps_the_same_state_with_the_kernel_and_without(model, kw, engines, images, monkeypatch):
    """A batch cache under A-VL (small text floors: its decode steps evict text), 8 steps: every
    layer's tables and scores (region, core, text score) after each step and the tokens are equal
    with the one-call text step and with the per-layer torch ops."""
    from vlkv.runtime.policies import avl

    engine = engines[model]
    prompts = [
        Prompt("Describe the picture.", [images[0]]),
        Prompt("What is in this image? Say.", [images[1]]),
    ]
    runs = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            m.setattr(evict_rows, "FUSED_DROP", fused)
            calls: list[int] = []
            real = evict_rows.avl_text_step
            m.setattr(evict_rows, "avl_text_step", lambda *a, c=calls, f=real: c.append(1) or f(*a))
            policy, batch = avl.AVLPolicy(**kw), engine.encode(prompts)
            cache = engine.new_cache(batch)
            tokens, states = [], []
            with torch.no_grad():
                tok = engine.prefill(batch, policy, cache).logits.argmax(-1)
                for step in range(1, 9):
                    tok = engine.decode(tok, batch, policy, cache, step).logits.argmax(-1)
                    tokens.append(tok.tolist())
                    states.append(_state(cache))
            cache.release()
            runs.append((tokens, states, len(calls)))
    (got_tok, got, calls), (want_tok, want, none) = runs
    assert calls == 8 and none == 0
    assert got_tok == want_tok
    lengths = [[layer["lengths"] for layer in s] for s in got]
    assert len({str(x) for x in lengths}) > 1  # the steps changed the lengths (appends, evictions)
    for g, w in zip(got, want, strict=True):
        _same(g, w)
