"""``kvzip`` / ``kvgrad``: query-agnostic selection from the replay scores, budgets, sinks, bad input."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.runtime.cli_refusal import (
    refused as _refused,
)  # the no_model_compute fixture: tests/runtime/conftest.py
from vlkv.runtime.backend import StepStats
from vlkv.runtime.ort_backend import OrtBackend
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.replay import ReplayRequest

TEXT = "The cat sat on the mat while the dog slept by the warm fire all night long."


def _prompts(images):
    return [Prompt(TEXT, [images[0]]), Prompt("Two pictures here.", [images[1], images[2]]), Prompt("Hi.")]


@pytest.mark.parametrize("name", ["kvzip", "kvgrad"])
def test_budget_one_is_the_full_cache_token_for_token(engines, images, name):
    engine = engines["tiny-llava"]
    full = engine.generate(_prompts(images), make_policy("full"), max_new_tokens=6)
    same = engine.generate(_prompts(images), make_policy(name, budget=1.0, chunk_size=5), max_new_tokens=6)
    for a, b in zip(full.samples, same.samples):
        assert a.token_ids == b.token_ids and a.kept_per_layer == b.kept_per_layer


def _scored(engine, images, **kw):
    """A prefilled full cache, the policy's edits computed from real replay scores, and those scores."""
    policy = make_policy("kvzip", **kw)
    batch = engine.encode(_prompts(images))
    cache = engine.new_cache(batch)
    engine.prefill(batch, make_policy("full"), cache)
    ctx = engine.context(batch)
    stats = StepStats([None] * len(cache.layers))
    stats.replay = engine.replay(policy, ctx, batch, cache)
    return policy, batch, cache, stats.replay, policy.after_prefill(cache, stats, ctx)


def _kept(edit, b):
    return [set(edit.index[b, h, : int(edit.keep_len[b])].tolist()) for h in range(edit.index.shape[1])]


def test_layer_scope_keeps_sinks_plus_each_heads_top_scores(engines, images):
    policy, batch, cache, scores, edits = _scored(
        engines["tiny-llava"], images, budget=0.3, scope="layer", heads="own"
    )
    for b, n in enumerate(batch.lengths.tolist()):
        k = max(round(0.3 * n), policy.sinks + 1)
        for edit, score in zip(edits, scores):
            assert int(edit.keep_len[b]) == k
            for h, kept in enumerate(_kept(edit, b)):
                rest = score[b, h, policy.sinks : n].float()
                top = torch.argsort(rest, descending=True, stable=True)[: k - policy.sinks] + policy.sinks
                assert kept == set(range(policy.sinks)) | set(top.tolist())


def test_model_scope_spreads_one_ranking_over_layers(engines, images):
    policy, batch, cache, scores, edits = _scored(engines["tiny-llava"], images, budget=0.4, heads="own")
    layers, heads = len(scores), scores[0].shape[1]
    for b, n in enumerate(batch.lengths.tolist()):
        k = max(round(0.4 * n), policy.sinks + 1)
        counts = [int(e.keep_len[b]) for e in edits]
        assert sum(counts) == layers * k  # the mean budget is the policy's
        # each layer's count is its share of the model-wide top L·H_kv·k (sinks first), rounded
        flat = torch.cat(
            [
                s[b, :, :n].clone().index_fill_(1, torch.arange(policy.sinks), float("inf")).reshape(-1)
                for s in scores
            ]
        )
        picks = torch.sort(flat, descending=True, stable=True).indices[: layers * heads * k] // (heads * n)
        share = torch.bincount(picks, minlength=layers).double() / heads
        # (a layer at the floor of sinks + 1 may hold more than its share, the others then less)
        low = policy.sinks + 1
        assert all(abs(c - s) < 1 or c == low or s < low for c, s in zip(counts, share.tolist())), (
            counts,
            share,
        )
        assert len(set(counts)) > 1 or len(set(share.tolist())) == 1  # non-uniform where the ranking is
        for edit in edits:
            assert all(set(range(policy.sinks)) <= kept for kept in _kept(edit, b))


def test_shared_heads_keep_one_set_per_layer(engines, images):
    _, batch, _, _, edits = _scored(engines["tiny-llava"], images, budget=0.4, heads="shared", scope="layer")
    for edit in edits:
        for b in range(len(batch.prompts)):
            kept = _kept(edit, b)
            assert all(k == kept[0] for k in kept)


@pytest.mark.parametrize("name", ["kvzip", "kvgrad"])
def test_compressed_generation_keeps_the_budget(engines, images, name):
    engine = engines["tiny-qwen2-vl"]
    policy = make_policy(name, budget=0.3, chunk_size=8, heads="own")
    out = engine.generate(_prompts(images), policy, max_new_tokens=3)
    for s in out.samples:
        k = max(round(0.3 * s.prompt_tokens), 5)
        # kept after prefill (+ the generated tokens appended since) averages the budget over layers
        assert sum(s.kept_per_layer) == len(s.kept_per_layer) * (k + 2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(chunk_size=0), "chunk_size must be >= 1"),
        (dict(chunk_size=-3), "chunk_size must be >= 1"),
        (dict(budget=0.0), "budget must be in"),
        (dict(budget=1.5), "budget must be in"),
        (dict(sinks=-1), "sinks must be >= 0"),
        (dict(every=0), "every must be >= 1"),
        (dict(scope="global"), "scope must be one of"),
        (dict(heads="some"), "heads must be one of"),
        (dict(mode="prompt", template=" "), "template must not be empty"),
    ],
)
@pytest.mark.parametrize("name", ["kvzip", "kvgrad"])
def test_bad_settings_name_the_field(name, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_policy(name, **kwargs)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--policy", "kvzip", "--budget", "0.5", "--set", "chunk_size=0"], "chunk_size must be >= 1, got 0"),
        (["--policy", "kvgrad", "--budget", "1.5"], "budget must be in (0.0, 1.0], got 1.5"),
        (
            ["--policy", "kvgrad", "--budget", "0.5", "--backend", "onnxruntime"],
            "kvgrad needs gradients through the model, which only the PyTorch backend has",
        ),
        (
            ["--policy", "kvzip", "--budget", "0.5", "--backend", "onnxruntime"],
            "the replay step (kvzip) is not available on the onnxruntime backend",
        ),
        (
            ["--policy", "kvzip", "--set", "allocator=pyramid"],
            "allocator cannot be combined with policy 'kvzip'",
        ),
    ],
)
def test_cli_refuses_in_one_line(capsys, no_model_compute, argv, needle):  # noqa: F811
    assert needle in _refused(capsys, *argv)


def test_backends_without_replay_refuse_in_one_line(engines, images, monkeypatch):
    with pytest.raises(ValueError, match="kvgrad needs gradients") as err:
        OrtBackend.replay(
            SimpleNamespace(name="onnxruntime"), ReplayRequest(gradient=True), None, None, None, None
        )
    assert "\n" not in str(err.value)
    engine = engines["tiny-llava"]
    monkeypatch.setattr(engine.backend, "supports_replay", False)
    with pytest.raises(ValueError, match=r"the replay step \(kvzip\) is not available"):
        engine.generate([Prompt("Hi")], make_policy("kvzip", budget=0.5), max_new_tokens=2)


@pytest.mark.parametrize("heads", ["own", "adaptive"])
def test_a_linked_prefill_is_replayed_too(engines, images, heads):
    from vlkv.runtime.link.spec import LinkSpec

    engine = engines["tiny-llava"]
    prompts = [Prompt("First look.", [images[0]]), Prompt("Second look at it.", [images[0]])]
    policy = make_policy("kvzip", budget=0.3, heads=heads)
    out = engine.generate(prompts, policy, max_new_tokens=2, link=LinkSpec("mpic", 2), link_threshold=0.0)
    assert out.extras["store"]["hits"] >= 1, out.extras["store"]
    for s in out.samples:
        k = max(round(0.3 * s.prompt_tokens), 5)
        layers = len(s.kept_per_layer)
        # adaptive: per-layer counts are means over heads, rounded
        slack = 0 if heads == "own" else layers
        assert abs(sum(s.kept_per_layer) - layers * (k + 1)) <= slack


def _held(layer, b):
    """Real entries per KV head of sample ``b`` (holes excluded)."""
    n = int(layer.lengths[b])
    open_ = layer.open_mask(n)
    return [n] * layer.kv_heads if open_ is None else open_[b].sum(1).tolist()


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_adaptive_heads_keep_their_own_count_of_their_best(engines, images, scope):
    """``heads="adaptive"``: one ranking decides each head's count; each head keeps its own best
    entries; the others become holes that hold no bytes."""
    engine = engines["tiny-llava"]
    policy, batch, cache, scores, edits = _scored(engine, images, budget=0.3, scope=scope, heads="adaptive")
    heads = scores[0].shape[1]
    from vlkv.runtime.edits import apply_edits

    apply_edits(cache, edits)
    uneven = False
    for b, n in enumerate(batch.lengths.tolist()):
        k = max(round(0.3 * n), policy.sinks + 1)
        ranked = [
            s[b, :, :n].clone().float().index_fill_(1, torch.arange(policy.sinks), float("inf"))
            for s in scores
        ]
        groups = [ranked] if scope == "model" else [[r] for r in ranked]
        want_counts = []
        for group in groups:
            flat = torch.cat([r.reshape(-1) for r in group])
            picks = torch.sort(flat, descending=True, stable=True).indices[: len(group) * heads * k] // n
            want_counts += torch.bincount(picks, minlength=len(group) * heads).clamp(min=1).tolist()
        held = [c for layer in cache.layers for c in _held(layer, b)]
        assert held == want_counts
        uneven |= len(set(held)) > 1
        # each head's real entries are its best ``count`` (sinks first)
        for layer, r in zip(cache.layers, ranked):
            open_ = layer.open_mask(int(layer.lengths[b]))
            for h in range(heads):
                real = layer.positions[b, h, : int(layer.lengths[b]), 0]
                real = set(real[open_[b, h]].tolist()) if open_ is not None else set(real.tolist())
                c = len(real)
                assert real == set(torch.argsort(r[h], descending=True, stable=True)[:c].tolist())
    assert uneven  # the ranking really gave heads different budgets
    per_head_entry = cache.pool.spec.entry_bytes // heads
    total = sum(sum(_held(layer, b)) for layer in cache.layers for b in range(len(batch.prompts)))
    assert cache.kv_bytes() == total * per_head_entry == cache.pool.used_bytes()


@pytest.mark.parametrize("name", ["kvzip", "kvgrad"])
def test_adaptive_generation_runs_and_budget_one_is_exact(engines, images, name):
    engine = engines["tiny-qwen2-vl"]
    full = engine.generate(_prompts(images), make_policy("full"), max_new_tokens=4)
    same = engine.generate(
        _prompts(images), make_policy(name, budget=1.0, heads="adaptive"), max_new_tokens=4
    )
    assert [s.token_ids for s in full.samples] == [s.token_ids for s in same.samples]
    out = engine.generate(
        _prompts(images), make_policy(name, budget=0.3, chunk_size=8, heads="adaptive"), max_new_tokens=3
    )
    for s in out.samples:
        k = max(round(0.3 * s.prompt_tokens), 5)
        # per head, on average over layers, about the budget (+ 2 appended tokens; each head >= 1)
        mean = sum(s.kept_per_layer) / len(s.kept_per_layer)
        assert abs(mean - (k + 2)) <= 1.0, (mean, k)
