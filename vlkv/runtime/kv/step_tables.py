"""A decode step's table rows for every layer, built once per step: what the device path's one-launch
append (``vlkv.plugins.paged_append_triton``) reads in place of per-request, per-layer tensor ops.

A scheduler's batch view holds each request's one-sample caches: their entry tables are separate
tensors per request and layer. Written column by column from Python that was ~8 tensor ops per request
and layer, and the paged read's table ~9 more a layer (``kv/paged.paged_tables``). :class:`StepTables`
is nano-vllm's ``slot_mapping`` + ``block_table`` in this layout: at the step's first layer it grows
every layer's tables for the new column (what each layer's reservation would do), reads where each
column goes and which run slot it takes, and packs per (layer, request) the tables' addresses, the
capacity, the column, the run id, the length after and the running-score tables' addresses into one
``(L, B, FIELDS)`` int64 tensor (one
host-to-device copy a step). Every layer's launch reads its rows of that tensor; the read's lengths and
attended counts are views of it, also built once.

The rows name tensors by address, so a layer uses them only while they hold (:meth:`StepTables.holds`):
the tables are the same tensors (kept alive here), the reservation put each column and slot where the
rows say. Anything else — an edit between layers, a table regrown, a request off its run — and that
layer takes the Python append, as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the fields of a row (``paged_append_kernels`` reads them by these numbers): the addresses of a
# request's slot, position, modality, order and hole tables (0: no holes), its table capacity, the new
# column, its run slot (-1: none), the length after the append, then the addresses of up to
# ``MAX_SCORES`` running-score tables (0: none; the launch zeroes their new column: a statistics
# policy's reservation zeroed it with 2 ops per table, request and layer)
SLOTS, CAP, POSITIONS, MODALITY, ORDER, HOLES, COLUMN, RUN, AFTER, SCORES = range(10)
MAX_SCORES = 3  # A-VL keeps three (region, core flag, text score), H2O one
FIELDS = SCORES + MAX_SCORES
_NAMES = ("slots", "positions", "modality", "order", "holes")


class StepTables:
    """Per layer and request the table rows of one decode step (see the module docstring).

    Attributes:
        meta: ``(L, B, FIELDS)`` int64 on the pool's device (fields: ``paged_append_kernels``).
        columns: per layer each request's new column (its length before), Python ints.
        runs: per layer each request's run slot (``SpareSlots.peek_run_id``), or None where some
            request of the layer takes no run slot (the launch then takes the reservation's ids).
        lengths: per layer ``(B, H_kv)`` int64 lengths after the append (stride 0 over heads).
        attended: per layer ``(B,)`` float64 entries each request attends (no holes: its length).
    """

    def __init__(self, layers: list[list], device: torch.device):
        """``layers``: per layer its requests' one-sample caches (``LayerKV``, as many each)."""
        self.columns: list[list[int]] = []
        self.runs: list[list[int] | None] = []
        self._tables: list[list[tuple]] = []
        self._scores: list[list[tuple]] = []  # per layer each request's running-score tables
        self._fits: list[bool] = []
        rows = []
        for per in layers:
            cols = [r.host_lengths()[0] for r in per]
            for r, p in zip(per, cols):  # the growth the layer's reservation would do, done now
                r._reserve(p + 1)
            runs = [r.spares.peek_run_id() for r in per]
            tables = [table_tensors(r) for r in per]
            scores = [tuple(r.scores.values()) for r in per]
            self._fits.append(all(fits(t, p, sc) for t, p, sc in zip(tables, cols, scores)))
            self.columns.append(cols)
            self.runs.append(None if any(i is None for i in runs) else runs)
            self._tables.append(tables)
            self._scores.append(scores)
            rows.extend(meta_row(t, sc, p, run) for t, p, run, sc in zip(tables, cols, runs, scores))
        n_layers, batch = len(layers), len(layers[0]) if layers else 0
        host = torch.tensor(rows, dtype=torch.long, device="cpu")  # built on the host, copied once
        self.meta = to_device(host, device).view(n_layers, batch, FIELDS)
        after = self.meta[:, :, AFTER]
        heads = layers[0][0].kv_heads if batch else 1
        self.lengths = list(after[:, :, None].expand(n_layers, batch, heads).unbind(0))
        self.attended = list(after.double().unbind(0))

    def holds(self, layer: int, owners: list, res) -> bool:
        """Whether layer ``layer``'s rows hold for its reservation ``res``
        (:class:`~vlkv.runtime.kv.reservation.DecodeReservation`) over ``owners``: the same tables,
        contiguous with room for the column, each column where the reservation put it and (where the
        rows have run ids) the run slots it took; the same running-score tables (the launch zeroes
        their column in place of the reservation: ``reserve_decode_entries(zero_scores=False)``)."""
        if not self._fits[layer] or res.host != self.columns[layer]:
            return False
        runs = self.runs[layer]
        # (a spare that is not an int is held ids, a tensor: compared as a list it would be read back)
        if runs is not None and not (all(type(s) is int for s in res.spare) and res.spare == runs):
            return False
        return all(
            all(getattr(r, name) is t for name, t in zip(_NAMES, tables))
            and len(r.scores) == len(scores)
            and all(a is b for a, b in zip(r.scores.values(), scores))
            for r, tables, scores in zip(owners, self._tables[layer], self._scores[layer])
        )

    def width(self, layer: int) -> int:
        """The layer's read table width: its longest request after the append."""
        return max(self.columns[layer]) + 1


def table_tensors(layer) -> tuple:
    """A one-sample layer's ``(slots, positions, modality, order, holes)`` tables, as a meta row names them."""
    return tuple(getattr(layer, name) for name in _NAMES)


def meta_row(tables: tuple, scores: tuple, column: int, run: int | None) -> list[int]:
    """One (layer, request)'s ``FIELDS`` int64 fields: ``tables`` as :func:`table_tensors` gives them,
    ``scores`` its running-score tables (the first ``MAX_SCORES``), the new ``column``, its run slot."""
    slots, positions, modality, order, holes = tables
    row = [0] * FIELDS
    row[SLOTS], row[CAP], row[POSITIONS] = slots.data_ptr(), slots.shape[2], positions.data_ptr()
    row[MODALITY], row[ORDER] = modality.data_ptr(), order.data_ptr()
    row[HOLES] = 0 if holes is None else holes.data_ptr()
    row[COLUMN], row[RUN], row[AFTER] = column, -1 if run is None else run, column + 1
    for i, score in enumerate(scores[:MAX_SCORES]):  # more: the layer does not fit
        row[SCORES + i] = score.data_ptr()
    return row


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``: on CUDA through pinned memory without blocking (a pageable copy may wait
    for the stream: a host sync a step); the caching host allocator keeps the pinned block until the
    copy ran."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def fits(tables: tuple, column: int, scores: tuple = ()) -> bool:
    """A request's tables as the kernel addresses them: contiguous ``(1, H_kv, C[, P])`` with ``C`` above
    ``column``, holes (if any) one byte an entry, at most ``MAX_SCORES`` float32 running-score tables
    shaped like the slot table."""
    slots, positions, modality, order, holes = tables
    if len(scores) > MAX_SCORES or any(
        s.shape != slots.shape or s.dtype != torch.float32 or not s.is_contiguous() for s in scores
    ):
        return False
    cap = slots.shape[2]
    same = all(
        t.shape[:3] == slots.shape for t in (positions, modality, order) + (() if holes is None else (holes,))
    )
    dense = all(t.is_contiguous() for t in tables if t is not None)
    kinds = slots.dtype == order.dtype == positions.dtype == torch.long and modality.dtype == torch.int8
    return (
        same
        and dense
        and kinds
        and slots.shape[0] == 1
        and column < cap
        and (holes is None or holes.dtype == torch.bool)
    )
