"""Shared tolerances and input builders for the plugin tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# (rtol, atol) for outputs stored in the input dtype: about one to two units in the last place.
OUT_TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
# Statistics are float32 sums of identical products whatever the input dtype; only the order differs.
STATS_TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-4, 1e-5),
    torch.bfloat16: (1e-4, 1e-5),
}


def assert_close_tol(actual: torch.Tensor, expected: torch.Tensor, tol: dict, dtype: torch.dtype) -> None:
    rtol, atol = tol[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@dataclass(frozen=True)
class StatsCase:
    """One attention-statistics problem: q (B, H, Q, D), k (B, Hkv, S, D) and its masks."""

    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int
    dim: int
    causal: bool = True
    ragged: bool = False  # random key_lengths and query_rows
    offset: bool = False  # explicit q_offset instead of key_lengths - Q

    def make(self, dtype: torch.dtype) -> dict:
        q = torch.randn(self.batch, self.heads, self.queries, self.dim).to(dtype)
        k = torch.randn(self.batch, self.kv_heads, self.keys, self.dim).to(dtype)
        args = {"q": q, "k": k, "scale": self.dim**-0.5, "causal": self.causal, "threshold": 0.05}
        if self.ragged:
            args["key_lengths"] = torch.randint(1, self.keys + 1, (self.batch,))
            args["key_lengths"][0] = self.keys
            args["query_rows"] = torch.rand(self.batch, self.queries) > 0.3
        if self.offset:
            lengths = args.get("key_lengths", torch.full((self.batch,), self.keys))
            args["q_offset"] = torch.randint(0, self.keys, (self.batch,)).minimum(lengths - 1)
        return args


STATS_CASES = (
    StatsCase(1, 2, 2, 1, 1, 16),
    StatsCase(2, 6, 2, 5, 9, 8, ragged=True),
    StatsCase(3, 3, 1, 7, 81, 40, ragged=True, offset=True),
    StatsCase(2, 2, 2, 6, 81, 16, causal=False, ragged=True),
)
BIG_STATS_CASE = StatsCase(1, 3, 1, 9, 729, 32, ragged=True)


@dataclass(frozen=True)
class SelectCase:
    """Selected attention: q (B, H, Q, D), k/v (B, Hkv, S, D), K indices per (sample, KV head)."""

    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int
    dim: int
    selected: int

    def make(self, dtype: torch.dtype) -> dict:
        q = torch.randn(self.batch, self.heads, self.queries, self.dim).to(dtype)
        k = torch.randn(self.batch, self.kv_heads, self.keys, self.dim).to(dtype)
        v = torch.randn(self.batch, self.kv_heads, self.keys, self.dim).to(dtype)
        lengths = torch.randint(0, self.selected + 1, (self.batch, self.kv_heads))
        lengths[0, 0] = 0  # an empty selection must give zeros
        lengths[-1, -1] = self.selected
        indices = torch.stack(
            [torch.randperm(self.keys)[: self.selected] for _ in range(self.batch * self.kv_heads)]
        ).view(self.batch, self.kv_heads, self.selected)
        # Padding past `lengths` may hold anything, including out-of-range slots.
        pad = torch.arange(self.selected)[None, None, :] >= lengths[..., None]
        indices = torch.where(pad, torch.full_like(indices, 10**6), indices)
        return {"q": q, "k": k, "v": v, "indices": indices, "lengths": lengths, "scale": self.dim**-0.5}


SELECT_CASES = (
    SelectCase(1, 2, 2, 1, 1, 16, 1),
    SelectCase(2, 6, 2, 1, 9, 8, 5),
    SelectCase(3, 3, 1, 2, 81, 40, 30),
)
BIG_SELECT_CASE = SelectCase(2, 6, 2, 1, 729, 64, 219)


@dataclass(frozen=True)
class MergeCase:
    """Token merging: k/v (B, Hkv, S, D) mapped onto S_out targets, some sources dropped."""

    batch: int
    kv_heads: int
    keys: int
    dim: int
    targets: int

    def make(self, dtype: torch.dtype) -> dict:
        k = torch.randn(self.batch, self.kv_heads, self.keys, self.dim).to(dtype)
        v = torch.randn(self.batch, self.kv_heads, self.keys, self.dim).to(dtype)
        assign = torch.randint(-1, self.targets, (self.batch, self.kv_heads, self.keys))
        counts = torch.zeros(self.batch, self.kv_heads, self.targets, dtype=torch.int64)
        counts.scatter_add_(2, assign.clamp_min(0), (assign >= 0).long())
        return {"k": k, "v": v, "assign": assign, "counts": counts}


MERGE_CASES = (MergeCase(1, 1, 1, 16, 1), MergeCase(2, 3, 9, 8, 4), MergeCase(3, 2, 81, 40, 30))
BIG_MERGE_CASE = MergeCase(1, 2, 729, 64, 200)


@dataclass(frozen=True)
class LowRankCase:
    """Inputs of the rank-space decode attention (AttentionPack path (b))."""

    batch: int
    kv_heads: int
    group: int
    dim: int
    rows: tuple[int, ...]  # valid factor rows per sample (T = the max + 2 padding rows)
    dense: tuple[int, ...]  # valid dense entries per sample (S = the max + 1)
    rank_k: int
    rank_v: int

    def make(self, dtype: torch.dtype, seed: int = 0) -> dict:
        g = torch.Generator().manual_seed(seed)
        b, hkv, d = self.batch, self.kv_heads, self.dim
        t, s = max(self.rows) + 2, max(self.dense) + 1

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        # factor scales keep the scores O(1), as an SVD's do (left factors scaled by the singular values)
        return {
            "q": rnd(b, hkv * self.group, d),
            "kbar": rnd(b, t, self.rank_k),
            "dk": rnd(b, self.rank_k, hkv * d, scale=self.rank_k**-0.5),
            "vbar": rnd(b, t, self.rank_v),
            "dv": rnd(b, self.rank_v, hkv * d, scale=self.rank_v**-0.5),
            "rows": torch.tensor(self.rows),
            "k": rnd(b, hkv, s, d),
            "v": rnd(b, hkv, s, d),
            "dense_len": torch.tensor(self.dense),
        }


LOWRANK_CASES = [
    LowRankCase(1, 1, 1, 16, (1,), (1,), 1, 1),
    LowRankCase(2, 2, 3, 16, (63, 0), (5, 65), 8, 24),
    LowRankCase(2, 3, 2, 24, (65, 129), (0, 33), 16, 16),
    LowRankCase(3, 2, 20, 8, (130, 1, 64), (2, 0, 64), 40, 17),
]
