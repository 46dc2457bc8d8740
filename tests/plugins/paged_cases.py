"""Paged-attention test cases shared by the paged read's tests (reference, CPU form, Triton kernels,
probabilities, low-rank rows): ragged rows, holes, GQA 1/3/7, decode and prefill chunks, per-head and
shared tables, pre-RoPE rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCase:
    """q (B, G·H_kv, Q, D) over a pool (H_kv, S, D); each request's row of ``cols`` table columns.

    layout: "perhead" (every head its own random slots), "runs" (the same ascending runs in every
    head: what the pool hands out), "appends" (one run, then 5 single slots: decode appends in a fixed
    pool), "holes" (runs with holes, ragged head lengths).
    """

    batch: int
    kv_heads: int
    group: int
    queries: int
    cols: int
    dim: int
    layout: str = "perhead"
    runs: int = 1
    full: bool = False  # every row holds all `cols` entries (no padding, no empty row)
    rope: int = 0  # > 0: about half the entries pre-RoPE, rotated on read over this many dims

    def make(self, dtype: torch.dtype, seed: int = 0) -> dict:
        g = torch.Generator().manual_seed(seed)
        b, h, c = self.batch, self.kv_heads, self.cols
        slots = b * c + 11  # spare slots: the requests do not tile the pool
        q = torch.randn(b, h * self.group, self.queries, self.dim, generator=g).to(dtype)
        k_pool = torch.randn(h, slots, self.dim, generator=g).to(dtype)
        v_pool = torch.randn(h, slots, self.dim, generator=g).to(dtype)
        if self.layout == "perhead":
            table = torch.stack([torch.randperm(slots, generator=g)[:c] for _ in range(b * h)]).view(b, h, c)
            lengths = torch.randint(0, c + 1, (b, h), generator=g)
        else:
            # request r's columns as `runs` ascending runs, shuffled across the pool, the same per head
            perm = torch.randperm(b, generator=g)
            rows = []
            for r in range(b):
                base = torch.arange(int(perm[r]) * c, int(perm[r]) * c + c)
                if self.layout == "appends":  # a prompt's run, then appends one slot each (descending)
                    rows.append(torch.cat([base[: c - 5], base[c - 5 :].flip(0)]))
                    continue
                pieces = list(base.tensor_split(self.runs))
                order = torch.randperm(len(pieces), generator=g).tolist()
                rows.append(torch.cat([pieces[i] for i in order]))
            table = torch.stack(rows)[:, None].expand(b, h, c).contiguous()
            lengths = torch.randint(0, c + 1, (b, 1), generator=g).expand(b, h).contiguous()
        lengths[-1] = c
        if self.full:
            lengths.fill_(c)
        if not self.full:
            lengths[0, 0] = 0  # an empty row: its query heads must be zeros
        if self.layout == "holes":
            hole = (torch.rand(b, h, c, generator=g) < 0.2) & (torch.arange(c) > 0)
            table = torch.where(hole, torch.full_like(table, -1), table)
            lengths = (lengths - torch.randint(0, 2, (b, h), generator=g)).clamp_min(0)
        # padding past a row's length may hold anything, including slots out of range
        pad = torch.arange(c)[None, None, :] >= lengths[..., None]
        table = torch.where(pad, torch.full_like(table, 10**6), table)
        args = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "table": table, "lengths": lengths}
        args["scale"] = self.dim**-0.5
        if self.rope:
            args.update(rope_rows(self.rope, b, h, c, g))
            # padding and holes may name any row, out of range included: they are never read
            args["rot"] = torch.where(pad | (table < 0), 10**6, args["rot"])
        return args


def rope_rows(rot_dims: int, b: int, h: int, c: int, g: torch.Generator, rows: int = 20) -> dict:
    """``rot (B, H_kv, C)``: a random row of 20 for about half the entries, -1 (post-RoPE) for the rest;
    ``cos, sin (20, rot_dims)`` in HF's layout."""
    theta = torch.rand(rows, rot_dims // 2, generator=g) * 100
    rot = torch.randint(0, rows, (b, h, c), generator=g)
    rot = torch.where(torch.rand(b, h, c, generator=g) < 0.5, rot, -1)
    return {"rot": rot, "cos": theta.cos().repeat(1, 2), "sin": theta.sin().repeat(1, 2)}


CASES = (
    PagedCase(1, 1, 1, 1, 1, 16),
    PagedCase(2, 2, 3, 1, 9, 8),
    PagedCase(3, 1, 7, 3, 9, 40),
    PagedCase(2, 3, 3, 1, 81, 64, layout="runs", runs=3),
    PagedCase(2, 2, 1, 5, 81, 16, layout="holes", runs=2),
    PagedCase(2, 3, 3, 4, 81, 32, layout="runs", runs=1),
)
BIG = PagedCase(2, 2, 3, 1, 729, 64, layout="runs", runs=2)
APPENDS = (PagedCase(3, 2, 3, 1, 81, 16, layout="appends"), PagedCase(2, 3, 1, 6, 81, 8, layout="appends"))
# pre-RoPE entries: every dim rotated, and partial rotary (the first 8 of 16/40 dims)
ROPE = (
    PagedCase(2, 2, 3, 1, 81, 16, layout="runs", rope=16),
    PagedCase(3, 1, 7, 3, 9, 40, layout="holes", runs=2, rope=8),
    PagedCase(2, 3, 1, 2, 81, 16, rope=8),
)


def loop_reference(q, k_pool, v_pool, table, lengths, scale) -> torch.Tensor:
    """One float64 softmax per (request, query head, query row) over the slots it sees: the spec."""
    batch, heads, num_q, _ = q.shape
    group = heads // k_pool.shape[0]
    out = torch.zeros(batch, heads, num_q, v_pool.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for j in range(heads):
            h = j // group
            n = int(lengths[b, h])
            for i in range(num_q):
                ids = [int(s) for s in table[b, h, : max(0, n - num_q + i + 1)] if s >= 0]
                if not ids:
                    continue
                k, v = k_pool[h, ids].double(), v_pool[h, ids].double()
                p = torch.softmax(k @ q[b, j, i].double() * scale, dim=0)
                out[b, j, i] = p @ v
    return out


def compiled_variants(kernel) -> int:
    """How many binaries Triton has compiled for ``kernel`` (a JITFunction) on any device: the first
    element of each device's cache entry is its kernel dict (Triton 3.x)."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())
