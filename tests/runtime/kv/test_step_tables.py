"""``kv/step_tables.StepTables``: a decode step's rows name each request's tables, the column and run
slot its reservation then takes, and hold only while that stays true."""

from __future__ import annotations

import torch

from vlkv.runtime.cache import LayerKV
from vlkv.runtime.kv import step_tables as st
from vlkv.runtime.kv.pool import KVPool, PoolSpec
from vlkv.runtime.kv.reservation import reserve_decode_entries

H, D, P = 2, 4, 3


def _layers(lengths=(3, 5), n_layers=2, run_reserve=4):
    """Per layer one-sample caches (a scheduler's batch view), each holding a prompt of ``lengths[b]``
    entries with ``run_reserve`` spares after it (its run)."""
    pool = KVPool(
        PoolSpec(num_layers=n_layers, kv_heads=H, head_dim=D, dtype=torch.float32, device="cpu"), grow=True
    )
    layers = []
    for at in range(n_layers):
        per = []
        for n in lengths:
            r = LayerKV(pool, at, 1, P)
            r.run_reserve = run_reserve
            k = torch.randn(1, H, n, D)
            r.append(k, k, torch.arange(n)[None, :, None].expand(1, n, P), torch.zeros(1, n, dtype=torch.int8),
                     torch.tensor([n]))  # fmt: skip
            per.append(r)
        layers.append(per)
    return layers


def test_rows_name_the_tables_the_column_and_the_run_slot_the_reservation_takes():
    layers = _layers()
    caps = [[r.capacity for r in per] for per in layers]
    step = st.StepTables(layers, torch.device("cpu"))
    assert step.meta.shape == (2, 2, st.FIELDS)
    for at, per in enumerate(layers):
        for b, r in enumerate(per):
            row = step.meta[at, b].tolist()
            assert row[st.SLOTS] == r.slots.data_ptr() and row[st.ORDER] == r.order.data_ptr()
            assert row[st.COLUMN] == r.host_lengths()[0] < row[st.CAP] == r.capacity >= caps[at][b]
            assert row[st.AFTER] == row[st.COLUMN] + 1
        assert torch.equal(step.lengths[at], torch.tensor([[4, 4], [6, 6]]))
        assert torch.equal(step.attended[at], torch.tensor([4.0, 6.0], dtype=torch.float64))
        res = reserve_decode_entries(per)
        assert step.runs[at] == res.spare and all(isinstance(s, int) for s in res.spare)
        assert step.holds(at, per, res)
        assert step.width(at) == 6


def test_rows_do_not_hold_once_a_table_or_a_column_changed():
    layers = _layers()
    step = st.StepTables(layers, torch.device("cpu"))
    first, second = layers
    second[1].order = second[1].order.clone()  # an edit replaced a table
    assert step.holds(0, first, reserve_decode_entries(first))
    assert not step.holds(1, second, reserve_decode_entries(second))
    # a layer appended twice in the step: its column is not the one the rows name
    again = _layers(n_layers=1)[0]
    step = st.StepTables([again], torch.device("cpu"))
    reserve_decode_entries(again)
    assert not step.holds(0, again, reserve_decode_entries(again))


def test_requests_off_their_run_have_no_run_ids():
    layers = _layers(run_reserve=0)  # no spares: slots come fresh from the pool
    step = st.StepTables(layers, torch.device("cpu"))
    assert step.runs == [None, None]
    assert (step.meta[:, :, st.RUN] == -1).all()
    res = reserve_decode_entries(layers[0])
    assert step.holds(0, layers[0], res) and res.ids.shape == (H, 2)


def test_rows_name_the_score_tables_and_the_reservation_leaves_their_column():
    """A statistics policy's running scores: the rows carry their addresses (the launch zeroes the new
    column), a reservation with ``zero_scores=False`` leaves it as it was; a score table replaced or
    added after the rows were built, or more than ``MAX_SCORES`` of them: the rows do not hold."""
    layers = _layers()
    for per in layers:
        for r in per:
            r.ensure_score("a")
    layers[0][1].ensure_score("b")
    step = st.StepTables(layers, torch.device("cpu"))  # grows the tables (new columns zero)
    for per in layers:
        for r in per:
            for s in r.scores.values():
                s.fill_(5.0)  # in place: the tensors the rows name
    for at, per in enumerate(layers):
        for b, r in enumerate(per):
            row = step.meta[at, b].tolist()
            names = list(r.scores.values())
            assert row[st.SCORES : st.SCORES + len(names)] == [s.data_ptr() for s in names]
            assert all(x == 0 for x in row[st.SCORES + len(names) : st.FIELDS])
    first, second = layers
    res = reserve_decode_entries(first, zero_scores=False)
    assert step.holds(0, first, res)
    assert all((s[0, :, p] != 0).all() for r, p in zip(first, res.host) for s in r.scores.values())
    res = reserve_decode_entries(second)  # the default zeroes them (the Python append's reservation)
    assert all((s[0, :, p] == 0).all() for r, p in zip(second, res.host) for s in r.scores.values())
    second[0].scores["a"] = second[0].scores["a"].clone()  # an edit replaced a score table
    assert not step.holds(1, second, res)
    layers = _layers(n_layers=1)
    layers[0][0].ensure_score("late")
    step = st.StepTables(layers, torch.device("cpu"))
    layers[0][1].ensure_score("late")  # a score table the rows do not name
    assert not step.holds(0, layers[0], reserve_decode_entries(layers[0], zero_scores=False))
    layers = _layers(n_layers=1)
    for name in "abcd"[: st.MAX_SCORES + 1]:
        layers[0][0].ensure_score(name)
    step = st.StepTables(layers, torch.device("cpu"))
    assert not step.holds(0, layers[0], reserve_decode_entries(layers[0], zero_scores=False))
