"""The real-text continuation protocol: windows, compress-once scoring, shared prefills, intervals."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from vlkv.eval.continuation import (
    Window,
    continuation_nll,
    paired_delta,
    ppl,
    run_protocol,
    shared_continuation_nll,
    text_windows,
)
from vlkv.eval.corpus import paragraphs
from vlkv.runtime.policies import make_policy


def _tokenize(text: str) -> list[int]:
    return [ord(c) % 97 for c in text]


def test_text_windows_interleave_sources_and_follow_the_text():
    texts = [("a", "x" * 100 + "abcdefghij" * 30), ("b", "y" * 400)]
    ws = text_windows(_tokenize, texts, per_text=3, context=20, continuation=5)
    assert [w.source.split("@")[0] for w in ws] == ["a", "b"] * 3
    assert all(len(w.context) == 20 and len(w.continuation) == 5 for w in ws)
    ids = _tokenize(texts[0][1])
    start = int(ws[2].source.split("@")[1])
    assert ws[2].context + ws[2].continuation == tuple(ids[start : start + 25])
    assert len(ids) - 25 - 2 <= int(ws[4].source.split("@")[1]) <= len(ids) - 25  # spread to the end
    with pytest.raises(ValueError, match="fewer than"):
        text_windows(_tokenize, [("short", "abc")], 1, 20, 5)


def test_paired_delta_point_and_interval():
    base = torch.rand(12, 8, generator=torch.Generator().manual_seed(0)) + 1
    assert paired_delta(base, base) == (0.0, 0.0, 0.0)
    point, lo, hi = paired_delta(base + 0.1, base)
    assert (
        point == pytest.approx(math.exp(0.1) - 1)
        and lo == pytest.approx(point)
        and hi == pytest.approx(point)
    )
    noisy = base + 0.1 * torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    point, lo, hi = paired_delta(noisy, base, n_boot=500)
    assert lo < point < hi
    assert ppl(base) == pytest.approx(math.exp(float(base.double().mean())))
    with pytest.raises(ValueError, match="same|both"):
        paired_delta(base[:3], base)


@pytest.fixture(scope="module")
def windows(engines):
    tok = engines["tiny-llava"].tokenizer
    text = " ".join(paragraphs())
    return text_windows(
        lambda s: tok(s, add_special_tokens=False)["input_ids"], [("corpus", text)], 2, 96, 12
    )


def test_full_cache_chunked_continuation_equals_token_by_token_decode(engines, windows):
    """Scoring the continuation in one chunk over the cache = feeding it one token at a time."""
    engine = engines["tiny-llava"]
    full = make_policy("full")
    chunked = continuation_nll(engine, windows, full).nll
    from vlkv.eval.continuation import _batch

    batch = _batch(windows, engine.pad_id)
    cache = engine.new_cache(batch)
    rows = [engine.prefill(batch, full, cache).logits]
    cont = torch.tensor([w.continuation for w in windows])
    for t in range(cont.shape[1] - 1):
        rows.append(engine.decode(cont[:, t], batch, full, cache, t + 1).logits)
    logits = torch.stack(rows, 1).float()
    stepwise = torch.nn.functional.cross_entropy(logits.flatten(0, 1), cont.flatten(), reduction="none")
    torch.testing.assert_close(chunked, stepwise.view_as(chunked), rtol=1e-4, atol=1e-4)


def test_compression_is_once_and_reported_in_bytes(engines, windows):
    engine = engines["tiny-llava"]
    full = continuation_nll(engine, windows, make_policy("full"))
    snap = continuation_nll(engine, windows, make_policy("snapkv", budget=0.25, window=8))
    assert snap.kv_bytes < full.kv_bytes == full.full_kv_bytes
    assert snap.peak_kv_bytes == full.peak_kv_bytes  # the prefill writes every entry first
    assert 0 < snap.meta_bytes < full.meta_bytes
    assert not torch.equal(snap.nll, full.nll)


def test_shared_prefill_equals_one_prefill_per_policy(engines, windows):
    engine = engines["tiny-llava"]
    policies = [
        make_policy("local", budget=0.3),
        make_policy("full"),
        make_policy("snapkv", budget=0.5, window=8),
        make_policy("snapkv", budget=0.2, window=8, kernel=3),
        make_policy("pyramidkv", budget=0.3, window=8),
        make_policy("h2o", budget=0.3),
        make_policy("h2o", budget=0.5),
        make_policy("avl", budget=0.3, prefill_keep=0.9),
        make_policy("kvzip", budget=0.5, heads="adaptive"),  # shares the replay of the next one
        make_policy("kvzip", budget=0.3),  # scored by a replay over the prefilled cache
    ]
    shared = shared_continuation_nll(engine, windows, policies)
    for policy, got in zip(policies, shared):
        one = continuation_nll(engine, windows, policy)
        assert torch.equal(got.nll, one.nll), policy
        assert (got.kv_bytes, got.meta_bytes) == (one.kv_bytes, one.meta_bytes), policy
    full, zipped = shared[1], shared[-1]
    assert zipped.kv_bytes < full.kv_bytes and not torch.equal(zipped.nll, full.nll)
    out = run_protocol(engine, windows, [("f", policies[1]), ("s", policies[2])], batch_size=1)
    assert out["f"]["nll"].shape == (len(windows), 12) and out["s"]["kv_bytes"] < out["f"]["kv_bytes"]


def test_windows_must_share_lengths(engines):
    ws = [Window("a", (1, 2, 3), (4, 5)), Window("b", (1, 2), (4, 5))]
    with pytest.raises(ValueError, match="share"):
        continuation_nll(engines["tiny-llava"], ws, make_policy("full"))


@pytest.mark.skipif(
    shutil.which("bible") is None, reason="optional KJV text absent: apt-get install bible-kjv"
)
def test_kjv_books_are_plain_prose():
    from vlkv.eval.corpus import kjv_books

    (name, text), *_ = kjv_books((("Ruth", 4),))
    assert name == "kjv:Ruth" and text.startswith("Now it came to pass in the days when the judges ruled")
    assert text.count("\n\n") == 3 and "Ruth1:" not in text and len(text.split()) > 2000


def test_kl_and_top1_against_the_stored_full_cache_logits(engines, windows, tmp_path):
    """The full run stores its logits; every configuration's per-token KL and top-1 agreement are
    taken against them, equal to the metrics on separately computed logits; the full cache itself
    scores KL 0 and agreement 1."""
    from vlkv.eval.continuation import ReferenceLogits
    from vlkv.eval.metrics import kl_divergence

    engine = engines["tiny-llava"]
    full, snap = make_policy("full"), make_policy("snapkv", budget=0.25, window=8)
    ref = ReferenceLogits(tmp_path / "ref")
    assert ref.get(windows) is None
    out = run_protocol(engine, windows, [("s", snap), ("f", full)], batch_size=1, reference=ref)
    assert ref.has(windows)
    assert torch.equal(out["f"]["kl"], torch.zeros_like(out["f"]["kl"])) and bool(out["f"]["top1"].all())
    stored = ref.get(windows)
    want = continuation_nll(engine, windows, snap, keep_logits=True)
    assert want.kl is None and want.logits.shape == stored.shape
    kl = kl_divergence(stored.flatten(0, 1), want.logits.flatten(0, 1)).view(len(windows), -1)
    torch.testing.assert_close(out["s"]["kl"], kl, rtol=1e-6, atol=1e-9)
    assert float(out["s"]["kl"].mean()) > 0
    top1 = stored.argmax(-1) == want.logits.argmax(-1)
    assert torch.equal(out["s"]["top1"], top1) and not bool(top1.all())
    # a later run without the full policy reuses the stored reference
    again = run_protocol(engine, windows, [("s", snap)], batch_size=2, reference=ref)
    torch.testing.assert_close(again["s"]["kl"], out["s"]["kl"], rtol=1e-6, atol=1e-9)
    # shared prefills give the same metrics as one prefill per policy
    shared = shared_continuation_nll(engine, windows, [full, snap], stored)
    torch.testing.assert_close(shared[1].kl, out["s"]["kl"], rtol=1e-6, atol=1e-9)
    # no reference: no metric, and a wrong-shaped reference names the mismatch
    assert "kl" not in run_protocol(engine, windows[:1], [("s", snap)])["s"]
    with pytest.raises(ValueError, match="do not match"):
        continuation_nll(engine, windows, snap, reference=stored[:, :-1])
    torch.save(torch.zeros(3, 5), ref.path(windows[0]))
    with pytest.raises(ValueError, match="delete it"):
        ref.get(windows)
