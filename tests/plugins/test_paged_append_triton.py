"""The device path's one-launch decode append (``paged_append_triton.decode_append_``) == its PyTorch
reference: pool rows and flags, every request's table column, the read table; run ids and per-head
ids, holes, ragged tables of different capacities, fp32/fp16/bf16; under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.kv import step_tables

tri = pytest.importorskip("vlkv.plugins.paged_append_triton", reason="triton is not installed")

B, H, D, P, S = 3, 2, 16, 3, 64


def _tables(g, caps, holes, n_scores=(1, 3, 0)):
    """Per request its ``(1, H, C_b[, P])`` tables with random content (holes: some columns), and
    ``n_scores[b]`` float32 running-score tables, nonzero everywhere (the launch zeroes the column)."""
    out = []
    for c, n in zip(caps, n_scores):
        t = {
            "slots": torch.randint(0, S, (1, H, c), generator=g),
            "positions": torch.randint(0, 99, (1, H, c, P), generator=g),
            "modality": torch.randint(0, 4, (1, H, c), generator=g).to(torch.int8),
            "order": torch.randint(0, 99, (1, H, c), generator=g),
            "holes": (torch.rand(1, H, c, generator=g) < 0.3) if holes else None,
            "scores": [torch.rand(1, H, c, generator=g) + 1 for _ in range(n)],
        }
        out.append(t)
    return out


def _meta(tables, cols, runs):
    """One layer's rows as ``StepTables`` packs them."""
    rows = []
    for t, p, run in zip(tables, cols, runs):
        row = [0] * step_tables.FIELDS
        row[step_tables.SLOTS], row[step_tables.CAP] = t["slots"].data_ptr(), t["slots"].shape[2]
        row[step_tables.POSITIONS] = t["positions"].data_ptr()
        row[step_tables.MODALITY], row[step_tables.ORDER] = t["modality"].data_ptr(), t["order"].data_ptr()
        row[step_tables.HOLES] = 0 if t["holes"] is None else t["holes"].data_ptr()
        row[step_tables.COLUMN], row[step_tables.RUN], row[step_tables.AFTER] = p, run, p + 1
        for i, score in enumerate(t["scores"]):
            row[step_tables.SCORES + i] = score.data_ptr()
        rows.append(row)
    # a layer before this one: the launch reads its own block of rows
    return torch.tensor([[[0] * step_tables.FIELDS] * len(rows), rows], dtype=torch.long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("run", [True, False], ids=["run", "per-head"])
@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
def test_decode_append_matches_reference(dtype, run, holes):
    _check_against_reference(dtype, run, holes, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("holes", [False, True], ids=["dense", "holes"])
def test_on_cuda_the_compiled_append_matches_reference(holes):
    """On a GPU (TRITON_INTERPRET=0: compiled): the tables reached through device addresses."""
    for dtype in (torch.float32, torch.bfloat16):
        for run in (True, False):
            _check_against_reference(dtype, run, holes, "cuda")


def _check_against_reference(dtype, run, holes, device):
    g = torch.Generator().manual_seed(5)
    caps, cols = [9, 40, 17], [4, 37, 0]  # different capacities, a column near the end, an empty row
    tables = _tables(g, caps, holes)
    k_pool, v_pool = torch.randn(H, S, D, generator=g).to(dtype), torch.randn(H, S, D, generator=g).to(dtype)
    prerope = torch.rand(H, S, generator=g) < 0.5
    qkv = torch.randn(B, 6, 1, D, generator=g).to(dtype)
    k, v = qkv[:, 2:4], qkv[:, 4:6]  # views of a fused q/k/v row, as the device layer hands them
    if run:
        runs = [11, 50, 3]
        ids = torch.tensor(runs).expand(H, B)
    else:
        runs = [-1] * B
        ids = torch.randperm(S, generator=g)[: H * B].view(H, B)
    pos = torch.randint(0, 99, (B, P), generator=g)
    mod = torch.randint(0, 4, (B,), generator=g).to(torch.int8)
    order = torch.randint(0, 99, (B,), generator=g)
    width = max(cols) + 1
    want = tri.decode_append_reference(
        k_pool, v_pool, prerope, k, v, tables, cols, ids, pos, mod, order, width
    )
    on = [x.to(device) for x in (k_pool, v_pool, prerope, k, v, ids, pos, mod, order)]
    k_pool, v_pool, prerope, k, v, ids, pos, mod, order = on
    tables = [{n: _to(t, device) for n, t in tb.items()} for tb in tables]
    out = torch.full((B, H, width), 7, dtype=torch.long, device=device)
    tri.decode_append_(
        k_pool, v_pool, prerope, k, v, _meta(tables, cols, runs).to(device), 1, pos, mod, order,
        ids=None if run else ids, out=out,
    )  # fmt: skip
    for got, w in zip((k_pool, v_pool, prerope), want[:3]):
        assert torch.equal(got.cpu(), w)
    for got, w in zip(tables, want[3]):
        scores = got.pop("scores")
        # the running scores: zero at the new column, untouched elsewhere
        assert len(scores) == len(w.get("scores", ())) and all(
            torch.equal(t.cpu(), x) for t, x in zip(scores, w.get("scores", ()))
        )
        for name, t in got.items():
            assert (t is None) == (w[name] is None) and (t is None or torch.equal(t.cpu(), w[name])), name
    out = out.cpu()
    # the read table up to each request's length after the append (past it: never read)
    lengths = torch.tensor(cols) + 1
    seen = torch.arange(width)[None, None, :] < lengths[:, None, None]
    assert torch.equal(out[seen.expand_as(out)], want[4][seen.expand_as(out)])


def _to(t, device):
    """A table (or a list of score tables, or None) on ``device``."""
    if isinstance(t, list):
        return [x.to(device) for x in t]
    return None if t is None else t.to(device)


def test_the_launch_zeroes_the_new_column_of_every_score_table():
    """The running scores' new column (what the reservation zeroed before): 0 in every head of each
    of a request's score tables (up to ``MAX_SCORES``), nothing else of them written."""
    g = torch.Generator().manual_seed(9)
    caps, cols = [6, 12, 5], [2, 11, 0]
    tables = _tables(g, caps, False, n_scores=(step_tables.MAX_SCORES, 1, 2))
    before = [[s.clone() for s in t["scores"]] for t in tables]
    k = torch.randn(B, H, 1, D, generator=g)
    pool, flags = torch.zeros(H, S, D), torch.zeros(H, S, dtype=torch.bool)
    pos, mod, order = (
        torch.zeros(B, P, dtype=torch.long),
        torch.zeros(B, dtype=torch.int8),
        torch.zeros(B).long(),
    )
    tri.decode_append_(pool, pool.clone(), flags, k, k, _meta(tables, cols, [1, 2, 3]), 1, pos, mod, order)
    for t, old, p in zip(tables, before, cols):
        for s, o in zip(t["scores"], old):
            assert torch.equal(s[0, :, p], torch.zeros(H))
            o[0, :, p] = 0
            assert torch.equal(s, o)


def test_meta_layout_and_bad_arguments_name_the_problem():
    from vlkv.plugins.paged_append_kernels import META_FIELDS

    assert META_FIELDS == step_tables.FIELDS
    k = torch.zeros(B, H, 1, D)
    pool, flags = torch.zeros(H, S, D), torch.zeros(H, S, dtype=torch.bool)
    pos, mod, order = (
        torch.zeros(B, P, dtype=torch.long),
        torch.zeros(B, dtype=torch.int8),
        torch.zeros(B).long(),
    )
    meta = torch.zeros(2, B, step_tables.FIELDS, dtype=torch.long)
    with pytest.raises(ValueError, match="meta must be"):
        tri.decode_append_(pool, pool, flags, k, k, meta[:, :2], 0, pos, mod, order)
    with pytest.raises(ValueError, match="layer 2 outside"):
        tri.decode_append_(pool, pool, flags, k, k, meta, 2, pos, mod, order)
    with pytest.raises(ValueError, match="modality int8"):
        tri.decode_append_(pool, pool, flags, k, k, meta, 0, pos, mod.long(), order)
    with pytest.raises(ValueError, match="ids must be"):
        tri.decode_append_(
            pool, pool, flags, k, k, meta, 0, pos, mod, order, ids=torch.zeros(H, B + 1).long()
        )
