"""Per-layer budget allocators: mean = target, bounds, density order, and composition with scorers."""

from __future__ import annotations

import pytest
import torch

from vlkv.plugins import AttnStats
from vlkv.runtime.policies import make_policy
from vlkv.runtime.policies.allocators import (
    STATE_FRACTIONS,
    AllocatedPolicy,
    PyramidAllocator,
    SparsityAllocator,
    keep_counts,
    make_allocator,
    proportional_shares,
)
from vlkv.runtime.policies.base import Policy
from vlkv.runtime.prompt import Prompt


def _stats(below: list[list[int]], visible: int) -> list[AttnStats]:
    """One fake AttnStats per layer: ``below[l][b]`` pruned entries of ``visible`` in each of 2 heads."""
    out = []
    for row in below:
        b = torch.tensor(row, dtype=torch.long)[:, None].expand(-1, 2)
        out.append(
            AttnStats(colsum=torch.zeros(len(row), 2, 4), below=b, visible=torch.full_like(b, visible))
        )
    return out


@pytest.mark.parametrize("target", [0.01, 0.05, 0.1, 0.3, 0.6, 0.9, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shares_average_to_target_within_bounds_and_follow_weights(target, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(12, 3, generator=gen, dtype=torch.float64) ** 3  # skewed: forces clipping
    shares = proportional_shares(weights, target, low=0.01, high=1.0)
    torch.testing.assert_close(
        shares.mean(0), torch.full((3,), target, dtype=torch.float64), rtol=0, atol=1e-9
    )
    assert bool((shares >= min(0.01, target) - 1e-12).all()) and bool((shares <= 1.0 + 1e-12).all())
    for b in range(3):  # heavier layers never get less
        order = torch.argsort(weights[:, b])
        assert bool((shares[order, b].diff() >= -1e-12).all())


def test_shares_without_redistribution_are_the_papers_clip():
    d = torch.tensor([[0.9], [0.5], [0.05], [0.05]], dtype=torch.float64)
    raw = 0.6 * 4 * d / d.sum()
    shares = proportional_shares(d, 0.6, low=0.01, high=1.0, redistribute=False)
    torch.testing.assert_close(shares, raw.clamp(0.01, 1.0))
    assert shares[0, 0] == 1.0 and shares.mean() < 0.6  # the clipped mass is lost, as in Algorithm 1


@pytest.mark.parametrize("n", [9, 81, 729])
def test_keep_counts_mean_matches_target_within_rounding(n):
    alloc = SparsityAllocator()
    below = [[v] for v in (3, 40, 10, 90, 60, 0, 75, 20)]
    for budget in (0.05, 0.2, 0.5):
        fr = alloc.fractions(budget, torch.tensor([n]), 8, _stats(below, 100))
        k = keep_counts(fr, torch.tensor([n]))
        assert bool((k >= 1).all()) and bool((k <= n).all())
        if bool((fr * n >= 0.5).all()):  # else min_keep = 1 lifts a layer above its rounded share
            assert abs(k.double().mean() / n - budget) <= 0.5 / n + 1e-12


def test_sparsity_denser_layers_get_more_per_sample():
    # sample 0: layer 2 densest; sample 1: layer 0 densest (allocations are per sample)
    below = [[80, 10], [50, 50], [10, 80], [90, 90]]
    fr = SparsityAllocator().fractions(0.3, torch.tensor([200, 200]), 4, _stats(below, 100))
    density = 1 - torch.tensor(below, dtype=torch.float64) / 100
    for b in range(2):
        assert torch.equal(torch.argsort(fr[:, b]), torch.argsort(density[:, b]))
    torch.testing.assert_close(fr.mean(0), torch.full((2,), 0.3, dtype=torch.float64))
    # shares ∝ density when nothing is clipped
    torch.testing.assert_close(fr[:, 0] / fr[:, 0].sum(), density[:, 0] / density[:, 0].sum())


def test_pyramid_decays_linearly_and_keeps_the_mean():
    fr = PyramidAllocator(beta=20).fractions(0.2, torch.tensor([100]), 5)[:, 0]
    torch.testing.assert_close(fr[0], torch.tensor(0.2 * (2 - 1 / 20), dtype=torch.float64))
    torch.testing.assert_close(fr[-1], torch.tensor(0.2 / 20, dtype=torch.float64))
    assert bool((fr.diff() < 0).all()) and abs(float(fr.mean()) - 0.2) < 1e-12
    high = PyramidAllocator(beta=4).fractions(0.8, torch.tensor([100]), 6)[:, 0]
    assert float(high.max()) == 1.0 and abs(float(high.mean()) - 0.8) < 1e-9


def test_uniform_equals_prompt_keep():
    n = torch.tensor([7, 50, 333])
    fr = make_allocator("uniform").fractions(0.35, n, 3)
    assert torch.equal(keep_counts(fr, n)[1], Policy(budget=0.35).prompt_keep(n))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(name="sparsity", threshold=0.0), "threshold"),
        (dict(name="sparsity", threshold=1.0), "threshold"),
        (dict(name="pyramid", beta=1.0), "beta"),
        (dict(name="uniform", floor=0.0), "floor"),
        (dict(name="pyramid", window=3), "unknown setting"),
        (dict(name="zigzag"), "unknown allocator"),
    ],
)
def test_allocator_settings_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_allocator(**kwargs)


def test_make_policy_composes_and_rejects():
    p = make_policy("h2o", budget=0.3, allocator="pyramid", allocator_beta=10)
    assert isinstance(p, AllocatedPolicy) and p.name == "h2o+pyramid" and p.allocator.beta == 10
    assert p.evicts_during_decode
    with pytest.raises(ValueError, match="elastic"):
        make_policy("elastic", budget=0.5, allocator="pyramid")
    with pytest.raises(ValueError, match="need allocator"):
        make_policy("snapkv", allocator_beta=3)


def test_allocated_scorer_gets_per_layer_lengths(engines, images):
    engine = engines["tiny-llava"]
    prompts = [
        Prompt("What is in the picture?", [images[0]]),
        Prompt("Compare them.", [images[1], images[2]]),
    ]
    batch = engine.encode(prompts)
    for name in ("snapkv", "h2o", "local"):
        policy = make_policy(name, budget=0.3, allocator="sparsity")
        cache = engine.new_cache(batch)
        engine.prefill(batch, policy, cache)
        expect = keep_counts(cache.policy_state[STATE_FRACTIONS], batch.lengths)
        assert torch.equal(cache.lengths(), expect), name
    assert len(set(cache.lengths()[:, 0].tolist())) > 1, "sparsity should size layers differently"


def test_uniform_allocator_reproduces_the_plain_scorer(engines, images):
    engine = engines["tiny-llava"]
    prompts = [Prompt("Describe the image.", [images[0]]), Prompt("Just text here.")]
    for name in ("snapkv", "h2o"):
        plain = engine.generate(prompts, make_policy(name, budget=0.4), max_new_tokens=4)
        wrapped = engine.generate(
            prompts, make_policy(name, budget=0.4, allocator="uniform"), max_new_tokens=4
        )
        for a, b in zip(plain.samples, wrapped.samples):
            assert a.token_ids == b.token_ids and a.kept_per_layer == b.kept_per_layer


def test_decode_evicting_scorer_holds_each_layer_at_its_fraction(engines, images):
    engine = engines["tiny-qwen2-vl"]
    policy = make_policy("h2o", budget=0.4, allocator="pyramid", allocator_beta=4)
    res = engine.generate([Prompt("Say something long.", [images[0]])], policy, max_new_tokens=6)
    n = res.samples[0].prompt_tokens
    fr = PyramidAllocator(beta=4).fractions(0.4, torch.tensor([n]), engine.backend.num_layers)[:, 0]
    processed = n + res.decode_steps
    expect = torch.round(fr * processed).long().tolist()
    assert res.samples[0].kept_per_layer == expect


def test_pyramidkv_fallback_is_snapkv_when_the_deepest_layer_cannot_hold_the_window(engines, images):
    """PyramidKV's reference code and kvpress: budget·n/beta < window → the uniform budget."""
    engine = engines["tiny-llava"]
    prompts = [Prompt("Describe the image in detail.", [images[0]])]
    snap = engine.generate(prompts, make_policy("snapkv", budget=0.3, window=16), max_new_tokens=3)
    fell_back = engine.generate(
        prompts, make_policy("pyramidkv", budget=0.3, beta=5, window=16, fallback=True), max_new_tokens=3
    )
    n = snap.samples[0].prompt_tokens
    assert 0.3 * n / 5 < 16  # the deepest layer would hold fewer entries than the window
    assert fell_back.samples[0].kept_per_layer == snap.samples[0].kept_per_layer
    assert fell_back.samples[0].token_ids == snap.samples[0].token_ids
    # a window the deepest layer can hold keeps the pyramid
    kept = (
        engine.generate(
            prompts, make_policy("pyramidkv", budget=0.3, beta=5, window=1, fallback=True), max_new_tokens=3
        )
        .samples[0]
        .kept_per_layer
    )
    assert 0.3 * n / 5 >= 1 and all(p > q for p, q in zip(kept, kept[1:])), kept
