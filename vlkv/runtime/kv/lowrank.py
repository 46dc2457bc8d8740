"""Low-rank segments (AttentionPack): a sample's image K/V held as joint-head truncated-SVD factors.

Per layer and sample, the pre-RoPE keys of the factored entries form a matrix ``M_k (T, H_kv·D)``
(heads concatenated, one row per token); a rank-``R`` truncated SVD ``M_k ≈ U S Vhᵀ`` is stored as
``K̄ = U·diag(S) (T, R)`` and ``D_k = Vhᵀ (R, H_kv·D)``, the same for values. Keys are factored
*before* RoPE (pre-RoPE keys are lower-rank) and rotated to each entry's own positions on read, so
a factored entry behaves like a linked shared one and M-RoPE positions stay whatever the table says.

The factored entries keep their slot-table columns (positions, modality, order, scores move with
every edit as usual); their pool slots are released and the table names a factor row instead:
``slot = -(1 + row)``. :meth:`LowRank.fill` writes the reconstructed rows into the dense K/V that
:meth:`~vlkv.runtime.kv.layer.LayerKV.attention_kv` hands a backend (path (a): reconstruct → rotate →
attend), so every backend step and every policy works unchanged. Rows no head references any more
(after an eviction) are dropped, so the bytes a cache reports are the bytes it holds.

Attention-aware decompression: each row has its own reconstruction rank (``rank_k``/``rank_v``,
at most the stored rank); an importance-driven policy lowers it for unimportant rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# randomized SVD: extra sampled directions beyond the kept rank, and power iterations; a rank that
# leaves fewer than OVERSAMPLE spare directions uses the exact SVD instead (full rank is exact)
OVERSAMPLE = 8
NITER = 2
SVD_SEED = 0  # the randomized SVD's fixed seed (see _randomized_svd)


def truncated_svd(m: Tensor, rank: int, exact: bool = False) -> tuple[Tensor, Tensor]:
    """Factor ``m (T, N)`` as ``bar (T, r) @ basis (r, N)`` with ``r = min(rank, T, N)`` (fp32 compute).

    ``bar = U·diag(S)``, ``basis = Vhᵀ`` of the best rank-``r`` approximation (Eckart–Young: the
    Frobenius error² is the sum of the discarded σ², exactly with ``exact``, nearly otherwise).
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    m = m.float()
    r = min(rank, *m.shape)
    if exact or r + OVERSAMPLE >= min(m.shape):
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        return u[:, :r] * s[:r], vh[:r]
    u, s, v = _randomized_svd(m, r + OVERSAMPLE, NITER)
    return u[:, :r] * s[:r], v[:, :r].T


def _randomized_svd(m: Tensor, q: int, niter: int) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.svd_lowrank(m, q, niter)`` (Halko et al. 2009, Alg. 5.1) with its random directions drawn
    from a generator seeded with ``SVD_SEED``, not the global RNG: a request's factors, hence its
    tokens, never depend on what else ran before it (a request in a stream equals its solo run).

    ``m (T, N)`` float32 → ``u (T, q)``, ``s (q,)``, ``v (N, q)``.
    """
    tall = m.shape[0] >= m.shape[1]
    a = m if tall else m.T
    gen = torch.Generator(device=a.device).manual_seed(SVD_SEED)
    omega = torch.randn(a.shape[1], q, dtype=a.dtype, device=a.device, generator=gen)
    basis = torch.linalg.qr(a @ omega).Q
    for _ in range(niter):  # power iterations sharpen the basis towards the top singular vectors
        basis = torch.linalg.qr(a.T @ basis).Q
        basis = torch.linalg.qr(a @ basis).Q
    u, s, vh = torch.linalg.svd(basis.T @ a, full_matrices=False)
    u, v = basis @ u, vh.T
    return (u, s, v) if tall else (v, s, u)


def _masked(bar: Tensor, ranks: Tensor) -> Tensor:
    """``bar (T, R)`` with the columns past each row's rank ``ranks (T,)`` zeroed."""
    cols = torch.arange(bar.shape[1], device=bar.device)[None, :]
    return torch.where(cols < ranks[:, None], bar, 0)


@dataclass
class Factors:
    """One sample's factored rows in one layer (storage dtype = the pool's).

    Attributes:
        kbar: ``(T, R_k)`` K̄ = U·diag(S) of the pre-RoPE keys. dk: ``(R_k, H_kv·D)`` D_k.
        vbar: ``(T, R_v)``. dv: ``(R_v, H_kv·D)``.
        rank_k, rank_v: ``(T,)`` int64 components each row is reconstructed with (<= R_k, R_v).
        post_rope: the keys were factored after RoPE (path (b): attention in the rank space, no
            rotation on read) instead of before it (path (a)).
    """

    kbar: Tensor
    dk: Tensor
    vbar: Tensor
    dv: Tensor
    rank_k: Tensor
    rank_v: Tensor
    post_rope: bool = False

    def __post_init__(self) -> None:
        if self.kbar.shape[0] != self.vbar.shape[0]:
            raise ValueError(
                f"kbar and vbar must have the same rows, got {self.kbar.shape} and {self.vbar.shape}"
            )

    @property
    def rows(self) -> int:
        return self.kbar.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kbar, self.dk, self.vbar, self.dv))

    def reconstruct(self, full: bool = False) -> tuple[Tensor, Tensor]:
        """``(T, H_kv·D)`` fp32 keys (pre-RoPE, or post-RoPE with ``post_rope``) and values, each row at
        its own rank unless ``full``."""
        kbar, vbar = self.kbar.float(), self.vbar.float()
        if not full:
            kbar, vbar = _masked(kbar, self.rank_k), _masked(vbar, self.rank_v)
        return kbar @ self.dk.float(), vbar @ self.dv.float()

    def take(self, rows: Tensor) -> Factors:
        """The factors of ``rows (T',)`` only (the bases are shared)."""
        return Factors(
            self.kbar[rows],
            self.dk,
            self.vbar[rows],
            self.dv,
            self.rank_k[rows],
            self.rank_v[rows],
            self.post_rope,
        )

    def bars_at_rank(self) -> tuple[Tensor, Tensor]:
        """``(K̄, V̄)`` fp32 ``(T, R)`` with each row's columns past its rank zeroed: attention in the
        rank space at the rows' reconstruction ranks."""
        return _masked(self.kbar.float(), self.rank_k), _masked(self.vbar.float(), self.rank_v)


class LowRank:
    """A layer's factored rows, one :class:`Factors` (or None) per sample."""

    def __init__(self, batch: int):
        self.samples: list[Factors | None] = [None] * batch

    def nbytes(self) -> int:
        return sum(f.nbytes() for f in self.samples if f is not None)

    @property
    def post_rope(self) -> bool:
        """Every sample's factors hold post-RoPE keys (the rank-space attention path applies)."""
        held = [f for f in self.samples if f is not None]
        return bool(held) and all(f.post_rope for f in held)

    def to(self, device: torch.device | str) -> LowRank:
        """A copy with every factor on ``device`` (a preempted request's factors swap with its K/V)."""
        out = LowRank(len(self.samples))
        out.samples = [
            None
            if f is None
            else Factors(
                *(t.to(device) for t in (f.kbar, f.dk, f.vbar, f.dv, f.rank_k, f.rank_v)), f.post_rope
            )
            for f in self.samples
        ]
        return out

    def fill(self, layer, k: Tensor, v: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Put the reconstructed, rotated rows into ``k, v (B, H_kv, n, D)`` where ``ids (B, H_kv, n)`` < 0."""
        b, h, n, d = k.shape
        out_k, out_v = k.clone(), v.clone()
        valid = layer.valid_mask()[:, None, :n]
        for s, f in enumerate(self.samples):
            if f is None:
                continue
            hs, cs = torch.nonzero((ids[s] < 0) & valid[s], as_tuple=True)
            if hs.numel() == 0:
                continue
            rk, rv = f.reconstruct()
            rows = -ids[s, hs, cs] - 1
            kk = rk.view(f.rows, h, d)[rows, hs]  # (N, D) pre-RoPE
            vv = rv.view(f.rows, h, d)[rows, hs]
            if not f.post_rope:
                pos = layer.positions[s, hs, cs]  # (N, P)
                kk = layer.pool.rope(kk.to(k.dtype)[None, None], pos[None, None])[0, 0]
            out_k[s, hs, cs] = kk.to(k.dtype)
            out_v[s, hs, cs] = vv.to(v.dtype)
        return out_k, out_v

    def prune(self, layer) -> None:
        """Drop factor rows that no valid entry of ``layer`` names any more; renumber the table."""
        valid = layer.valid_mask()[:, None, :].expand_as(layer.slots)
        for s, f in enumerate(self.samples):
            if f is None:
                continue
            named = (layer.slots[s] < 0) & valid[s]
            rows = -layer.slots[s][named] - 1
            used = torch.zeros(f.rows, dtype=torch.bool, device=layer.device)
            used[rows] = True
            if bool(used.all()):
                continue
            if not bool(used.any()):
                self.samples[s] = None
                continue
            keep = torch.nonzero(used).flatten()
            new = torch.full((f.rows,), -1, dtype=torch.long, device=layer.device)
            new[keep] = torch.arange(keep.numel(), device=layer.device)
            layer.slots[s][named] = -new[rows] - 1
            self.samples[s] = f.take(keep)


def factor(
    layer,
    select: Tensor,
    rank: int,
    rank_v: int | None = None,
    exact: bool = False,
    post_rope: bool = False,
) -> None:
    """Factor ``layer``'s entries chosen by ``select (B, H_kv, C)`` (valid, not yet factored) into
    each sample's low-rank rows, together with the rows it already holds (re-SVD of both).

    Args:
        layer: a :class:`~vlkv.runtime.kv.layer.LayerKV` whose pool has ``rope`` set.
        rank, rank_v: components kept for keys and for values (``rank_v`` defaults to ``rank``).
        exact: use the exact SVD (tests; the randomized one is the default).
        post_rope: factor the keys as attention reads them (after RoPE: path (b), attention in the
            rank space) instead of un-rotated (path (a)).

    Rows are tokens (by ``order``): an entry a head evicted earlier is a zero block in that head's
    columns, never read. The chosen entries' pool slots are released.
    """
    rope = layer.pool.rope
    if rope is None:
        raise RuntimeError("low-rank factoring needs pool.rope (keys are factored before RoPE)")
    rank_v = rank if rank_v is None else rank_v
    if layer.lowrank is None:
        layer.lowrank = LowRank(layer.batch)
    lr: LowRank = layer.lowrank
    h, d = layer.kv_heads, layer.pool.spec.head_dim
    dt, dev = layer.pool.spec.dtype, layer.device
    valid = layer.valid_mask()[:, None, :].expand_as(layer.slots)
    select = select.to(dev) & valid & (layer.slots >= 0)
    width = layer.max_length
    k, v = layer.attention_kv(width)  # other samples' factoring leaves sample s's entries alone
    for s in range(layer.batch):
        old = lr.samples[s]
        if not bool(select[s].any()):
            continue
        if old is not None and old.post_rope != post_rope:
            raise ValueError("a sample's factors cannot mix pre-RoPE and post-RoPE keys")
        held = (layer.slots[s] < 0) & valid[s]
        group = (select[s] | held)[:, :width]
        hs, cs = torch.nonzero(group, as_tuple=True)
        tokens, row = torch.unique(layer.order[s, hs, cs], return_inverse=True)
        mk = torch.zeros(tokens.numel(), h, d, dtype=torch.float32, device=dev)
        mv = torch.zeros_like(mk)
        new = select[s, hs, cs]
        # dense entries: stored rotated unless a shared (pre-RoPE) slot
        kd = k[s : s + 1, hs[new], cs[new]][:, None]  # (1, 1, N, D) post-RoPE as read
        pos = layer.positions[s, hs[new], cs[new]][None, None]
        pre = kd[0, 0] if post_rope else rope(kd, pos, inverse=True)[0, 0]
        mk[row[new], hs[new]] = pre.float()
        mv[row[new], hs[new]] = v[s, hs[new], cs[new]].float()
        if old is not None:  # re-SVD the held rows at their full stored rank
            ok, ov = old.reconstruct(full=True)
            rows_old = -layer.slots[s, hs[~new], cs[~new]] - 1
            mk[row[~new], hs[~new]] = ok.view(old.rows, h, d)[rows_old, hs[~new]]
            mv[row[~new], hs[~new]] = ov.view(old.rows, h, d)[rows_old, hs[~new]]
        kbar, dk = truncated_svd(mk.view(tokens.numel(), h * d), rank, exact)
        vbar, dv = truncated_svd(mv.view(tokens.numel(), h * d), rank_v, exact)
        t = tokens.numel()
        lr.samples[s] = Factors(
            kbar.to(dt),
            dk.to(dt),
            vbar.to(dt),
            dv.to(dt),
            torch.full((t,), kbar.shape[1], dtype=torch.long, device=dev),
            torch.full((t,), vbar.shape[1], dtype=torch.long, device=dev),
            post_rope,
        )
        layer.pool.release(layer.layer, layer.slots[s, hs[new], cs[new]], heads=hs[new])
        layer.slots[s, hs, cs] = -row - 1


def set_ranks(layer, sample: int, rank_k: Tensor, rank_v: Tensor) -> None:
    """Reconstruction ranks ``rank_k, rank_v (T,)`` for ``sample``'s factor rows (clamped to the stored rank)."""
    f = layer.lowrank.samples[sample] if layer.lowrank is not None else None
    if f is None:
        return
    f.rank_k = rank_k.clamp(max=f.kbar.shape[1]).to(f.rank_k)
    f.rank_v = rank_v.clamp(max=f.vbar.shape[1]).to(f.rank_v)


def densify(layer) -> None:
    """Write every factored entry back into fresh pool slots (rotated, at its reconstruction rank)."""
    if layer.lowrank is None:
        return
    width = layer.max_length
    k, v = layer.attention_kv(width)
    neg = (layer.slots[:, :, :width] < 0) & layer.valid_mask()[:, None, :width]
    layer.lowrank = None
    layer.charge_factors()  # the factors' slots serve the dense entries first
    for s in range(layer.batch):
        hs, cs = torch.nonzero(neg[s], as_tuple=True)
        if hs.numel() == 0:
            continue
        # the pool allocates the same count in every head
        counts = torch.bincount(hs, minlength=layer.kv_heads)
        ids = layer.pool.alloc(layer.layer, int(counts.max()))
        # heads with fewer factored entries than the most give their spare fresh slots back
        rank = torch.arange(hs.numel(), device=hs.device) - (torch.cumsum(counts, 0) - counts)[hs]
        slot = ids[hs, rank]
        layer.pool.write_entries(layer.layer, hs, slot, k[s, hs, cs], v[s, hs, cs])
        layer.slots[s, hs, cs] = slot
        spare = torch.arange(ids.shape[1], device=hs.device)[None, :] >= counts[:, None]
        sh, sc = torch.nonzero(spare, as_tuple=True)
        if sh.numel():
            layer.pool.release(layer.layer, ids[sh, sc], heads=sh)


def factorable(layer, modalities: frozenset[int] | None) -> Tensor:
    """``(B, H_kv, C)`` bool: ``layer``'s valid dense (pool-held) entries of ``modalities`` (None = every
    modality) that are no per-head hole: what a factor edit of those modalities factors."""
    want = layer.valid_mask()[:, None, :] & (layer.slots >= 0)
    if modalities is not None:
        codes = torch.tensor(sorted(modalities), dtype=layer.modality.dtype, device=layer.device)
        want = want & torch.isin(layer.modality, codes)
    if layer.holes is not None:
        want = want & ~layer.holes
    return want


def factorable_counts(layers, modalities: frozenset[int] | None) -> list[list[int]]:
    """Per layer and sample, the most :func:`factorable` entries one KV head holds (what a factor edit's
    ``threshold`` is compared with), read back once for every layer."""
    if not layers:
        return []
    return torch.stack([factorable(layer, modalities).sum(-1).amax(-1) for layer in layers]).tolist()


def apply_factor_edit(layer, edit) -> None:
    """Apply a :class:`~vlkv.runtime.policies.base.FactorEdit` to ``layer``: factor the chosen dense
    entries of every sample that is due (:func:`factor_due`), then set each sample's reconstruction
    ranks by importance (``kv/factor_ranks``; :func:`apply_factor_edits` does many layers at once)."""
    apply_factor_edits([(layer, edit)])


def apply_factor_edits(jobs: list[tuple]) -> None:
    """:func:`apply_factor_edit` of every ``(layer, FactorEdit)`` of ``jobs`` (distinct layers): each
    layer's factoring where due, then every layer's ranks by importance together, in a fixed number of
    tensor ops (:func:`~vlkv.runtime.kv.factor_ranks.set_ranks_by_importance`)."""
    from vlkv.runtime.kv.factor_ranks import rank_jobs, set_ranks_by_importance

    for layer, edit in jobs:
        factor_due(layer, edit)
    set_ranks_by_importance(rank_jobs(jobs))


def factor_due(layer, edit) -> None:
    """The factoring half of a :class:`~vlkv.runtime.policies.base.FactorEdit`: factor the chosen dense
    entries of every sample that is due (the ranks are left to
    :func:`~vlkv.runtime.kv.factor_ranks.set_ranks_by_importance`).

    The samples due are the edit's ``due`` where the policy decided them on the host (no read back
    unless one is due: a decode step's edit reads nothing), else counted here (one read back)."""
    if edit.due is None:
        want = factorable(layer, edit.modalities)
        due = want.sum(-1).amax(-1) >= edit.threshold  # (B,)
        factoring = bool(due.any())
    else:
        if len(edit.due) != layer.batch:
            raise ValueError(f"due: one flag per sample ({layer.batch}), got {len(edit.due)}")
        factoring = any(edit.due)  # none due (most steps): nothing is counted or built
        if factoring:
            want = factorable(layer, edit.modalities)
            due = torch.tensor(edit.due, dtype=torch.bool, device=layer.device)
    if factoring:
        factor(layer, want & due[:, None, None], edit.rank, exact=edit.exact, post_rope=edit.post_rope)
        layer.charge_factors()
