"""The backend's main attention picks a cheaper SDPA call where it can; each equals the masked reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from vlkv.runtime.backend import StepInputs
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.step_context import StepContext

RTOL, ATOL = 1e-5, 1e-6  # float32; the paths differ only in summation order


def masked_reference(q, k, v, scale, past, new_len):
    """The explicit-mask SDPA every path must equal: ``q (B, H, q, D)``, ``k/v (B, H_kv, S, D)``."""
    nq, s = q.shape[2], k.shape[2]
    j, i = torch.arange(s), torch.arange(nq)
    mask = (j[None, None, :] <= past[:, None, None] + i[None, :, None]) & (
        j[None, None, :] < (past + new_len)[:, None, None]
    )
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask[:, None], scale=scale
    )


def _qkv(b, h, hkv, nq, s, d=16):
    torch.manual_seed(b * 100 + nq + s)
    return torch.randn(b, h, nq, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)


@pytest.mark.parametrize("t", [1, 9, 81])
def test_plain_prefill_is_causal_path(t):
    q, k, v = _qkv(2, 6, 2, t, t)
    past, new_len = torch.zeros(2, dtype=torch.long), torch.full((2,), t)
    ctx = SimpleNamespace(plain=t > 1)
    got = StepContext._attend_full(ctx, q, k, v, 0.25, past, new_len)
    torch.testing.assert_close(got, masked_reference(q, k, v, 0.25, past, new_len), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("s", [1, 9, 729])
def test_decode_folds_query_heads(s):
    q, k, v = _qkv(3, 6, 2, 1, s)
    # ragged caches: sample 1 holds fewer entries than the widest, sample 2 adds nothing this step
    past = torch.tensor([s - 1, max(s // 2 - 1, 0), s - 1])
    new_len = torch.tensor([1, 1, 0 if s > 1 else 1])
    got = StepContext._attend_full(SimpleNamespace(plain=False), q, k, v, 0.3, past, new_len)
    want = masked_reference(q, k, v, 0.3, past, new_len)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)


def test_padded_prefill_keeps_the_mask():
    q, k, v = _qkv(2, 6, 2, 9, 9)
    past, new_len = torch.zeros(2, dtype=torch.long), torch.tensor([9, 4])
    got = StepContext._attend_full(SimpleNamespace(plain=False), q, k, v, 0.25, past, new_len)
    want = masked_reference(q, k, v, 0.25, past, new_len)
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[1, :, :4], want[1, :, :4], rtol=RTOL, atol=ATOL)


def test_step_takes_is_causal_only_for_an_unpadded_fresh_prefill(engines, images, monkeypatch):
    engine = engines["tiny-llava"]
    sdpa = F.scaled_dot_product_attention
    layers = engine.backend.num_layers

    def prefill(prompts) -> list[bool]:
        """Per language-model layer: did its attention run SDPA's is_causal path without a mask?"""
        batch = engine.encode(prompts)
        cache = engine.new_cache(batch)
        emb = engine.backend.embed(batch)  # the vision tower's own SDPA calls stay out of the count
        calls: list[bool] = []

        def spy(*args, **kw):
            calls.append(bool(kw.get("is_causal", False)) and kw.get("attn_mask") is None)
            return sdpa(*args, **kw)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        inputs = StepInputs(batch.input_ids, batch.positions, batch.modality, batch.lengths, emb)
        engine.backend.step(inputs, cache)
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        return calls

    assert prefill([Prompt("Describe the picture.", [images[0]])]) == [True] * layers
    # a batch of two lengths has padded rows, which need the mask
    two = [
        Prompt("Describe the picture.", [images[0]]),
        Prompt("Describe the picture in detail please.", [images[1]]),
    ]
    assert prefill(two) == [False] * layers


def test_plain_flag_reads_cache_and_padding():
    cache = SimpleNamespace(
        layers=[SimpleNamespace(lengths=torch.zeros(2, dtype=torch.long))],
        processed=torch.zeros(2, dtype=torch.long),
    )
    ids = torch.zeros(2, 5, dtype=torch.long)
    full = StepInputs(
        ids, torch.zeros(2, 5, 1, dtype=torch.long), torch.zeros(2, 5, dtype=torch.int8), torch.tensor([5, 5])
    )
    assert StepContext(cache, full, None).plain
    padded = StepInputs(ids, full.positions, full.modality, torch.tensor([5, 3]))
    assert not StepContext(cache, padded, None).plain
    cache.layers[0].lengths = torch.tensor([0, 2])
    assert not StepContext(cache, full, None).plain


@pytest.mark.parametrize("s", [1, 7, 300])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("threshold", [None, 0.05])
def test_decode_statistics_from_one_softmax_row(s, holes, threshold):
    """A decode step's statistics from its one softmax row per head equal the statistics kernel's
    reference, per KV head with holes, over ragged caches and unrequested rows."""
    from vlkv.plugins import attn_stats_reference
    from vlkv.runtime.attention_rows import _one_row_probs, _one_row_stats

    b, h, hkv, d = 3, 6, 2, 16
    q, k, v = _qkv(b, h, hkv, 1, s, d)
    past = torch.tensor([s - 1, max(s // 2 - 1, 0), s - 1])
    open_ = None
    if holes and s > 1:
        open_ = torch.rand(b, hkv, s, generator=torch.Generator().manual_seed(s)) > 0.3
        open_[:, :, 0] = True  # every head sees at least one entry
    rows = torch.tensor([[True], [True], [False]])
    probs, vis = _one_row_probs(q, k, 0.3, past, open_)
    got = _one_row_stats(probs, vis, rows, threshold)
    every = _one_row_stats(probs, vis, None, threshold)  # every sample's row requested
    every_ref = _one_row_stats(probs, vis, torch.ones_like(rows), threshold)
    for name in ("colsum", "below", "visible"):
        a, e = getattr(every, name), getattr(every_ref, name)
        assert (a is None and e is None) or torch.equal(a, e), name
    key_order = torch.arange(s)[None, None, :].expand(b, hkv, s)
    if open_ is not None:
        key_order = key_order.masked_fill(~open_, torch.iinfo(torch.long).max)
    ref = attn_stats_reference(
        q,
        k,
        0.3,
        query_rows=rows,
        causal=False,
        threshold=threshold,
        key_lengths=past + 1,
        key_order=key_order,
        query_order=past[:, None],
    )
    torch.testing.assert_close(got.colsum, ref.colsum, rtol=RTOL, atol=ATOL)
    assert torch.equal(got.visible, ref.visible)
    if threshold is None:
        assert got.below is None and ref.below is None
    else:
        assert torch.equal(got.below, ref.below) and int(got.below.sum()) > (0 if s > 7 else -1)
    assert vis is None if (open_ is None and s == 1) else vis is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("holes", [False, True])
def test_decode_output_from_the_statistics_probabilities(dtype, holes):
    """A decode step that takes statistics computes its output from the same probabilities (one read
    of the keys): it equals a float64 softmax reference as closely as SDPA does, over ragged caches,
    GQA and per-head holes."""
    import torch.nn.functional as F

    from vlkv.runtime.attention_rows import _one_row_out, _one_row_probs

    b, h, hkv, s, d = 3, 6, 2, 300, 16
    q, k, v = (t.to(dtype) for t in _qkv(b, h, hkv, 1, s, d))
    past = torch.tensor([s - 1, 140, 37])
    open_ = None
    if holes:
        open_ = torch.rand(b, hkv, s, generator=torch.Generator().manual_seed(3)) > 0.3
        open_[:, :, 0] = True
    probs, _ = _one_row_probs(q, k, 0.25, past, open_)
    got = _one_row_out(probs, v, q)
    assert got.shape == q.shape and got.dtype == dtype
    mask = (torch.arange(s)[None, :] <= past[:, None])[:, None, None, :]
    if open_ is not None:
        mask = mask & open_[:, :, None, :]
    g = h // hkv
    qg = q.reshape(b, hkv, g, d)
    scores = (qg.double() @ k.double().transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    want = (torch.softmax(scores, -1) @ v.double()).view(b, h, 1, d)
    sdpa = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=0.25).view(b, h, 1, d)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(sdpa.double(), want, **tol)


def test_h2o_decode_statistics_equal_the_reference_path(engines, images, monkeypatch):
    """End to end: H2O's logits and running scores over several decode steps are the same whether
    the step takes the one-row statistics or the general statistics pass."""
    import vlkv.runtime.step_context as sc
    from vlkv.runtime.policies import make_policy

    engine = engines["tiny-llava"]
    batch = engine.encode([Prompt("Describe this in detail please.", images=[images[0]]), Prompt("Hi there")])

    def run():
        policy = make_policy("h2o", budget=0.6)
        cache = engine.new_cache(batch)
        tok = engine.prefill(batch, policy, cache).logits.argmax(-1)
        logits = []
        for step in range(1, 6):
            out = engine.decode(tok, batch, policy, cache, step)
            logits.append(out.logits)
            tok = out.logits.argmax(-1)
        return torch.stack(logits), [lay.scores["h2o"].clone() for lay in cache.layers]

    import vlkv.plugins.paged_probs as paged_probs

    paged_calls = []
    # the fused CPU kernel's one read (the default on CPU fp32), else the two halves
    for name in ("paged_decode_probs", "fused_decode_probs"):
        real_paged = getattr(paged_probs, name)

        def counted(*a, _real=real_paged, **kw):
            got = _real(*a, **kw)
            paged_calls.append(got is not None)
            return got

        monkeypatch.setattr(paged_probs, name, counted)
    # the fused append-and-read (the default where its kernel builds) reads the tables with probabilities
    import vlkv.plugins.paged_append as paged_append

    real_fused = paged_append.append_attend
    monkeypatch.setattr(
        paged_append,
        "append_attend",
        lambda *a, **kw: paged_calls.append(kw["probs_width"] is not None) or real_fused(*a, **kw),
    )
    paged_logits, paged_scores = run()
    assert any(paged_calls)  # the one-row statistics read through the slot tables (the default)
    # the same one-row statistics over dense K/V (the read before paged reads)
    monkeypatch.setattr(sc.StepContext, "reads_paged", lambda self, layer, i: False)
    calls = []
    real = sc._one_row_probs
    monkeypatch.setattr(sc, "_one_row_probs", lambda *a: calls.append(1) or real(*a))
    row_logits, row_scores = run()
    assert calls  # the one-row statistics were taken
    torch.testing.assert_close(paged_logits, row_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(paged_scores, row_scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    old_attend = sc.StepContext.attend

    def attend(self, *args):
        self.one_row = False  # the separate statistics pass
        return old_attend(self, *args)

    monkeypatch.setattr(sc.StepContext, "attend", attend)
    calls.clear()
    plain_logits, plain_scores = run()
    assert not calls
    # the one-row step's output comes from its statistics' probabilities, the other's from SDPA
    torch.testing.assert_close(row_logits, plain_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(row_logits.argmax(-1), plain_logits.argmax(-1))
    for a, b in zip(row_scores, plain_scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _cuda_layout_sdpa(sdpa):
    """SDPA whose output has the strides CUDA's fused kernels give: ``(B, H, L, D)`` values stored as
    ``(B, L, H, D)``, so ``.view`` over heads fails where ``.reshape`` works (found on an H200)."""

    def call(*args, **kw):
        out = sdpa(*args, **kw)
        return out.transpose(1, 2).contiguous().transpose(1, 2) if out.dim() == 4 else out

    return call


@pytest.mark.parametrize("s", [1, 9, 81])
@pytest.mark.parametrize("ragged", [False, True])
def test_decode_reads_sdpa_outputs_of_any_layout(s, ragged, monkeypatch):
    q, k, v = _qkv(3, 6, 2, 1, s)
    past = torch.tensor([s - 1, max(s // 2 - 1, 0) if ragged else s - 1, s - 1])
    new_len = torch.ones(3, dtype=torch.long)
    want = StepContext._attend_full(SimpleNamespace(plain=False), q, k, v, 0.3, past, new_len)
    monkeypatch.setattr(F, "scaled_dot_product_attention", _cuda_layout_sdpa(F.scaled_dot_product_attention))
    got = StepContext._attend_full(SimpleNamespace(plain=False), q, k, v, 0.3, past, new_len)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_batched_generation_with_cuda_sdpa_layouts(engines, images, monkeypatch):
    """Every policy's batched decode with SDPA returning CUDA's strided outputs gives the same tokens."""
    from vlkv.runtime.policies import make_policy

    engine = engines["tiny-llava"]
    prompts = [Prompt("Describe it.", [images[0]]), Prompt("Two of them?", [images[1], images[2]])]
    for name, kw in (("full", {}), ("h2o", {"budget": 0.4}), ("vlcache", {"budget": 0.4})):
        want = engine.generate(prompts, make_policy(name, **kw), 4, stop_at_eos=False)
        with monkeypatch.context() as m:
            m.setattr(F, "scaled_dot_product_attention", _cuda_layout_sdpa(F.scaled_dot_product_attention))
            got = engine.generate(prompts, make_policy(name, **kw), 4, stop_at_eos=False)
        assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples], name
