"""A decode step's table writes for one-sample caches (``Appends.put_one`` via ``append_one_each``).

What must hold: the new column holds the entry's slots, positions, modality and order, zero scores and
no hole, every head alike; lengths, host lengths and the next order advance; ids, positions, modality
and order given as Python ints or as device tensors write the same; and one ``put_one`` dispatches at
most 2 ops per table plus the order and lengths arithmetic (it runs per request and layer of every
decode step: 18 ops each before in a scheduler step, 576 of 1,416 of a tiny-llava 8-layer one).
"""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.cache import LayerKV, append_one_each, private_pool
from vlkv.runtime.op_count import count_ops

H, D, P = 2, 8, 3


def _one_sample(n: int = 5, score: bool = True, holes: bool = True) -> LayerKV:
    """A one-sample layer holding ``n`` prompt entries (a running score table and a hole, optionally)."""
    g = torch.Generator().manual_seed(0)
    layer = LayerKV(private_pool(1, H, D, torch.float32, "cpu"), 0, 1, P)
    layer.append(
        torch.randn(1, H, n, D, generator=g),
        torch.randn(1, H, n, D, generator=g),
        torch.randint(0, 50, (1, n, P), generator=g),
        torch.zeros(1, n, dtype=torch.int8),
        torch.tensor([n]),
    )
    if score:
        layer.ensure_score("h2o").fill_(0.5)
    if holes:
        layer.holes = torch.zeros(layer.slots.shape, dtype=torch.bool)
        layer.holes[0, 1, 2] = True
    return layer


@pytest.mark.parametrize("as_tensors", [False, True], ids=["ints", "tensors"])
@pytest.mark.parametrize("order", [None, 40], ids=["next-order", "given-order"])
def test_put_one_writes_the_new_column(as_tensors, order):
    layer = _one_sample()
    p = layer.host_lengths()[0]
    before_order = int(layer.next_order[0])
    layer._reserve(p + 1)
    slot = int(layer.pool.alloc(0, 1)[0, 0])
    ids = torch.tensor([slot, slot + 1]) if as_tensors else slot
    pos = torch.tensor([7, 8, 9]) if as_tensors else [7, 8, 9]
    mod = torch.tensor(2) if as_tensors else 2
    given = None if order is None else (torch.tensor(order) if as_tensors else order)
    layer.put_one(p, ids, pos, mod, given)
    want_ids = [slot, slot + 1] if as_tensors else [slot, slot]
    assert layer.slots[0, :, p].tolist() == want_ids
    assert layer.positions[0, :, p].tolist() == [[7, 8, 9]] * H
    assert layer.modality[0, :, p].tolist() == [2] * H
    want_order = before_order if order is None else order
    assert layer.order[0, :, p].tolist() == [want_order] * H
    assert layer.next_order.tolist() == [want_order + 1]
    assert layer.scores["h2o"][0, :, p].tolist() == [0.0] * H
    assert layer.scores["h2o"][0, :, p - 1].tolist() == [0.5] * H  # only the new column
    assert layer.holes[0, :, p].tolist() == [False] * H and bool(layer.holes[0, 1, 2])
    assert layer.lengths.tolist() == [p + 1] and layer.host_lengths() == [p + 1]


@pytest.mark.parametrize("score", [False, True], ids=["no-score", "score"])
def test_put_one_ops_per_table(score):
    """Two ops per table column (a select and a fill or copy): 8 for the four tables of a row's column
    (:meth:`_put_column`; ``t[0, :, p] = x`` dispatched 3-5 each). The whole step of two rows (the
    reservation's order and lengths arithmetic, score zeroing and slot choice, the pool write, the
    columns) costs no more ops than when each row's column, order and lengths were written by
    ``put_one`` itself (before the Python append reserved first, as the fused one does): 51 for a
    plain cache, 55 with a running score table."""
    layers = [_one_sample(score=score, holes=False) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g)
    positions = [torch.tensor([5, 5, 5]), torch.tensor([6, 6, 6])]
    modality, orders = [torch.tensor(0), torch.tensor(0)], [torch.tensor(5), torch.tensor(5)]
    append_one_each(layers, k, v, positions, modality, orders)  # warm: table growth
    calls = []
    real = LayerKV._put_column

    def put_column(self, *args):
        with count_ops() as c:
            real(self, *args)
        calls.append(c.ops)

    LayerKV._put_column = put_column
    try:
        with count_ops() as whole:
            append_one_each(layers, k, v, positions, modality, [torch.tensor(6), torch.tensor(6)])
    finally:
        LayerKV._put_column = real
    assert calls == [8] * 2
    assert whole.ops <= (55 if score else 51)
    for layer in layers:
        assert layer.host_lengths() == [7] and layer.order[0, :, 6].tolist() == [6] * H
        assert layer.next_order.tolist() == [7]
