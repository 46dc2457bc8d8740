"""Low-rank segments: the SVD meets the Eckart–Young bound, full rank reproduces the dense cache,
factored slots are released (bytes reported == bytes held), any batch/image layout and M-RoPE work."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_image
from vlkv.runtime.backend import StepInputs
from vlkv.runtime.cache import Modality
from vlkv.runtime.kv.lowrank import densify, factor, truncated_svd
from vlkv.runtime.prompt import Prompt

MODELS = ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl"]


def _spectrum_matrix(t: int = 96, n: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(t, n, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    s = 0.8 ** torch.arange(n, dtype=torch.float32)  # decaying, like K/V spectra
    return (u * s) @ v.T


@pytest.mark.parametrize("rank", [1, 4, 16, 40, 64])
def test_exact_svd_error_is_the_discarded_singular_values(rank):
    m = _spectrum_matrix()
    bar, basis = truncated_svd(m, rank, exact=True)
    err2 = float(((bar @ basis - m) ** 2).sum())
    s = torch.linalg.svdvals(m.double())
    bound = float((s[rank:] ** 2).sum())
    assert abs(err2 - bound) <= 1e-4 * float((s**2).sum()) + 1e-6


def test_randomized_svd_is_near_the_bound_and_error_falls_with_rank():
    m = _spectrum_matrix()
    s = torch.linalg.svdvals(m.double())
    errs = []
    for rank in (2, 4, 8, 16, 32):
        bar, basis = truncated_svd(m, rank)
        err2 = float(((bar @ basis - m) ** 2).sum())
        bound = float((s[rank:] ** 2).sum())
        # fp32 rounding may land a hair under the bound; never more than 5 % above it
        assert (1 - 1e-5) * bound <= err2 <= 1.05 * bound + 1e-9, (rank, err2, bound)
        errs.append(err2)
    assert all(a > b for a, b in zip(errs, errs[1:]))


@pytest.mark.parametrize("shape", [(96, 64), (40, 120)])
def test_randomized_svd_ignores_the_global_rng(shape):
    # a request's factors (hence its tokens) must not depend on what consumed random numbers before it
    m = _spectrum_matrix(*shape) if shape[0] >= shape[1] else _spectrum_matrix(*shape[::-1]).T
    torch.manual_seed(1)
    first = truncated_svd(m, 4)
    torch.randn(1000)
    torch.manual_seed(2)
    again = truncated_svd(m, 4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    err2 = float(((first[0] @ first[1] - m) ** 2).sum())
    s = torch.linalg.svdvals(m.double())
    assert err2 <= 1.05 * float((s[4:] ** 2).sum()) + 1e-9  # a wide matrix factors as well as a tall one


def _prefill(engine, prompts):
    batch = engine.encode(prompts)
    cache = engine.new_cache(batch)
    inputs = StepInputs(
        batch.input_ids, batch.positions, batch.modality, batch.lengths, engine.backend.embed(batch)
    )
    engine.backend.step(inputs, cache)
    return batch, cache


def _images(layer):
    return (layer.modality == int(Modality.IMAGE)) & layer.valid_mask()[:, None, :]


@pytest.mark.parametrize("name", MODELS)
def test_full_rank_factors_reproduce_the_dense_cache_and_free_the_slots(name, engines, images):
    engine = engines[name]
    # a batch of 3 with 0, 1 and 2 images of different sizes
    prompts = [
        Prompt("Just text here.", []),
        Prompt("What is this?", [make_image(5, 96)]),
        Prompt("Compare them.", [images[0], make_image(6, 160)]),
    ]
    _, cache = _prefill(engine, prompts)
    pool = cache.pool
    for layer in cache.layers:
        before_k, before_v = layer.attention_kv()
        used = pool.used_slots(layer.layer)
        n_img = _images(layer)[:, 0].sum(-1)  # (B,)
        assert n_img[0] == 0 and n_img[1] > 0 and n_img[2] > n_img[1]
        factor(layer, _images(layer), rank=10**6, exact=True)
        after_k, after_v = layer.attention_kv()
        valid = layer.valid_mask()[:, None, :, None]
        # fp32 cache: inverse rotation, SVD and rotation back cost only rounding
        torch.testing.assert_close(after_k * valid, before_k * valid, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(after_v * valid, before_v * valid, rtol=1e-4, atol=1e-4)
        # the image entries' slots went back to the pool
        assert pool.used_slots(layer.layer) == used - int(n_img.sum())
        lr = layer.lowrank
        assert lr.samples[0] is None and lr.samples[1].rows == n_img[1] and lr.samples[2].rows == n_img[2]
        # reported bytes == dense slots held + factor tensors held
        dense = int(((layer.slots >= 0) & layer.valid_mask()[:, None, :]).sum()) // layer.kv_heads
        assert layer.kv_bytes() == dense * pool.spec.entry_bytes + lr.nbytes()
    h, d = pool.spec.kv_heads, pool.spec.head_dim
    t = int(n_img[2])
    r = min(t, h * d)
    assert cache.layers[-1].lowrank.samples[2].nbytes() == 2 * (t * r + r * h * d) * 4


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_reconstruction_error_falls_with_rank(name, engines, images):
    engine = engines[name]
    prompt = [Prompt("Describe.", [images[1]])]
    errs = []
    for rank in (2, 8, 32):
        _, cache = _prefill(engine, prompt)
        layer = cache.layers[1]
        k0, v0 = layer.attention_kv()
        img = _images(layer)
        factor(layer, img, rank=rank)
        k1, v1 = layer.attention_kv()
        m = img[..., None]
        errs.append(float(((k1 - k0) * m).norm() + ((v1 - v0) * m).norm()))
        # text entries are untouched
        assert torch.equal((k1 * ~m)[:, :, : k0.shape[2]], (k0 * ~m))
    assert errs[0] > errs[1] > errs[2] > 0


def test_factor_then_evict_prunes_rows_and_densify_restores_slots(engines, images):
    engine = engines["tiny-llava"]
    _, cache = _prefill(engine, [Prompt("What?", [images[0]])])
    layer = cache.layers[0]
    factor(layer, _images(layer), rank=8)
    rows = layer.lowrank.samples[0].rows
    n = int(layer.lengths[0])
    keep = torch.arange(0, n, 2)  # every other entry, the same in every head
    index = keep[None, None].expand(1, layer.kv_heads, -1).contiguous()
    k_before, v_before = layer.attention_kv()
    layer.select(index, torch.tensor([keep.numel()]))
    assert layer.lowrank.samples[0].rows < rows  # evicted image rows are dropped with their factors
    k_after, v_after = layer.attention_kv()
    torch.testing.assert_close(k_after, k_before[:, :, keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_after, v_before[:, :, keep], rtol=1e-5, atol=1e-5)
    used = cache.pool.used_slots(0)
    densify(layer)
    assert layer.lowrank is None and int((layer.slots[:, :, : keep.numel()] < 0).sum()) == 0
    assert cache.pool.used_slots(0) == used + int(_images(layer)[0, 0].sum())
    torch.testing.assert_close(layer.attention_kv()[0], k_after, rtol=1e-5, atol=1e-5)
    layer.release()
    assert cache.pool.used_slots(0) == 0


def test_factored_entries_survive_pool_compaction(engines, images):
    engine = engines["tiny-llava"]
    _, cache = _prefill(engine, [Prompt("What is it?", [images[0], images[1]])])
    for layer in cache.layers:
        k0, v0 = layer.attention_kv()
        factor(layer, _images(layer), rank=16)
        k1, v1 = layer.attention_kv()
        cache.pool.compact(layer.layer)
        k2, v2 = layer.attention_kv()
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
