"""The eager paged read's linked (pre-RoPE) keywords by the model's rotary table
(``kv/paged.rope_by_position``, through ``paged_tables``): every rotated column gets the same ``cos/sin``
as the row form they replaced (one row per linked entry, found by a boolean mask, the table sized by the
largest position), bit for bit, and nothing else is rotated; the paged read with them equals the read
with the old rows (fp32 bit-equal, bf16 too); 1-D RoPE (tiny LLaVA) and M-RoPE (tiny Qwen2-VL, its row
form and the Triton kernels' ``sec`` form); and the 1-D build reads nothing back (the row form: 3 syncs;
M-RoPE's rows of the rotated columns only still cost 2)."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.kv.test_paged_factors import MODELS, build_layer
from vlkv.plugins.paged_reference import paged_attention_reference
from vlkv.runtime.kv.paged import _columns, linked_prerope, paged_tables, rope_by_position
from vlkv.runtime.kv.rope_table import RopeTable, table_as_rows
from vlkv.runtime.op_count import count_ops

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def model_ropes(engines):
    return {p: engines[name].rope for p, name in MODELS.items()}


def _row_form(layer, table, lengths) -> dict:
    """The eager read's pre-RoPE keywords before session 18 (``kv/paged._rope_rows``' row form): one
    ``cos/sin`` row per held linked entry, found by mask, through ``Rope.cos_sin``."""
    n = table.shape[2]
    pre = linked_prerope(layer, table, lengths)
    if not bool(pre.any()):
        return {}
    positions = _columns(layer.positions, n)
    cos, sin = layer.pool.rope.cos_sin(layer.pool.keys[layer.layer], positions[pre][None])
    rot = torch.full_like(table, -1)
    rot[pre] = torch.arange(cos.shape[1])
    # in the pool's dtype, as a model of that dtype's rotary gives them (``Rope.cos_sin``'s 1-D table is
    # kept across calls whatever their dtype: these tests share the fp32 engines' Rope)
    like = layer.pool.keys[layer.layer]
    return {"rot": rot, "cos": cos[0].to(like.dtype), "sin": sin[0].to(like.dtype)}


def _rows_of(rope: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rotated (B, H_kv, n) bool, cos (R, D), sin (R, D))``: each rotated column's row, in order."""
    rot = rope["rot"]
    on = rot >= 0
    return on, rope["cos"][rot[on]], rope["sin"][rot[on]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pos_dims", [1, 3], ids=["rope-1d", "mrope"])
def test_the_table_form_rotates_each_linked_column_as_the_row_form_did(model_ropes, pos_dims, dtype):
    layer = build_layer(model_ropes[pos_dims], pos_dims, dtype)
    table, lengths, _, rope, _ = paged_tables(layer)
    old = _row_form(layer, table, lengths)
    assert rope.keys() == {"rot", "cos", "sin"} and rope["rot"].shape == table.shape
    on, cos, sin = _rows_of(rope)
    old_on, old_cos, old_sin = _rows_of(old)
    assert int(old_on.sum()) == 3 * layer.kv_heads  # the 3 linked entries, in every head
    assert torch.equal(on, old_on) and torch.equal(cos, old_cos) and torch.equal(sin, old_sin)
    # the read with either: the same output (the reference rotates in fp32 from the same rows)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(table.shape[0], 2 * layer.kv_heads, 1, layer.pool.spec.head_dim, generator=g).to(dtype)
    k_pool, v_pool = layer.pool.keys[layer.layer], layer.pool.values[layer.layer]
    got = paged_attention_reference(q, k_pool, v_pool, table, lengths, 0.25, **rope)
    want = paged_attention_reference(q, k_pool, v_pool, table, lengths, 0.25, **old)
    assert torch.equal(got, want)


def test_mrope_sec_form_names_the_same_rows(model_ropes):
    """M-RoPE's ``sec`` form (the Triton kernels') and the row form the eager read takes are one table
    read: ``table_as_rows`` of the first is the second."""
    layer = build_layer(model_ropes[3], 3, torch.float32)
    table, lengths, _, rope, _ = paged_tables(layer)
    pre = linked_prerope(layer, table, lengths)
    sec = rope_by_position(layer, pre, sec_form=True)
    assert sec["rot"].shape == (*table.shape, 3) and sec["sec"].dtype == torch.long
    rows, cos, sin = table_as_rows(sec["rot"], RopeTable(sec["cos"], sec["sin"], sec["sec"]))
    on, want_cos, want_sin = _rows_of(rope)
    assert (
        torch.equal(rows >= 0, on)
        and torch.equal(cos[rows[on]], want_cos)
        and torch.equal(sin[rows[on]], want_sin)
    )


@pytest.mark.parametrize("pos_dims", [1, 3], ids=["rope-1d", "mrope"])
def test_the_linked_table_build_reads_nothing_back(model_ropes, pos_dims):
    layer = build_layer(model_ropes[pos_dims], pos_dims, torch.float32)
    paged_tables(layer)  # the rotary table built once (a grown pool's is a one-time cost)
    with count_ops() as c:
        _, _, _, rope, _ = paged_tables(layer)
    # M-RoPE keeps the mask's any and its gather (rows for the rotated columns only: bounded bytes)
    assert rope and c.syncs == (0 if pos_dims == 1 else 2), dict(c.sites)
    if pos_dims == 3:
        assert rope["cos"].shape[0] == int((rope["rot"] >= 0).sum()) == 3 * layer.kv_heads
    # the row form it replaced read back: the mask's any, its gather, and (1-D) the largest position
    table, lengths = paged_tables(layer)[:2]
    with count_ops() as old:
        _row_form(layer, table, lengths)
    assert old.syncs == (3 if pos_dims == 1 else 2), dict(old.sites)


def test_a_triton_read_takes_mropes_table_form_and_reads_nothing_back(model_ropes, monkeypatch):
    """Where the read is the Triton kernel's (here forced: ``VLKV_FORCE_TRITON``), M-RoPE's keywords are the
    table form (``sec``): no host sync (the row form's mask costs 2 a layer on a GPU)."""
    from vlkv.plugins.ops import FORCE_TRITON_ENV

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    layer = build_layer(model_ropes[3], 3, torch.float32)
    paged_tables(layer)
    with count_ops() as c:
        table, _, _, rope, _ = paged_tables(layer)
    assert rope.keys() == {"rot", "cos", "sin", "sec"} and rope["rot"].shape == (*table.shape, 3)
    assert c.syncs == 0, dict(c.sites)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_paged_ops_read_the_table_form_as_the_row_form(model_ropes, dtype):
    """``ops.paged_attention`` and ``paged_decode_probs`` given M-RoPE's table form (``sec``) on a path
    without it (the CPU read, the reference) turn it into rows: the same output and probabilities as the
    row form, bit for bit."""
    from vlkv.plugins.ops import paged_attention
    from vlkv.plugins.paged_probs import paged_decode_probs

    layer = build_layer(model_ropes[3], 3, dtype)
    table, lengths, _, rows, _ = paged_tables(layer)
    pre = linked_prerope(layer, table, lengths)
    sec = rope_by_position(layer, pre, sec_form=True)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(table.shape[0], 2 * layer.kv_heads, 1, layer.pool.spec.head_dim, generator=g).to(dtype)
    k_pool, v_pool = layer.pool.keys[layer.layer], layer.pool.values[layer.layer]
    assert torch.equal(
        paged_attention(q, k_pool, v_pool, table, lengths, 0.25, **sec),
        paged_attention(q, k_pool, v_pool, table, lengths, 0.25, **rows),
    )
    got, got_vis = paged_decode_probs(q, k_pool, table, lengths, 0.25, **sec)
    want, want_vis = paged_decode_probs(q, k_pool, table, lengths, 0.25, **rows)
    assert torch.equal(got, want) and (got_vis is None) == (want_vis is None)
