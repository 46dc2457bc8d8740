"""vlkv's ``elastic`` against an independent port of the authors' Elastic Cache loop.

``scripts/elastic_reference.py`` re-implements the authors' ``ElasticCache`` and ``eval_ppl.py``
teacher-forced loop over Hugging Face's own eager forward (its own cache, masks and RoPE). With
``quirks=False`` it is the method as the paper states it; vlkv must equal it at every layer and
every step: the same kept entries (by position), the same merged K/V and the same logits.
"""

from __future__ import annotations

import pytest
import torch

from scripts.elastic_reference import ReferenceElastic, run_reference
from vlkv.runtime.cache import Modality
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import EncodedPrompt, Spans, collate

STEPS = 24


@pytest.fixture(scope="module")
def eager_lm():
    """A private copy of tiny-llava running HF's eager attention (the engine's copy runs vlkv's)."""
    from vlkv.runtime.models.registry import load_model

    model = load_model("tiny-llava").model
    model.set_attn_implementation("eager")
    return model


def _tokens(engine, n: int, seed: int) -> torch.Tensor:
    """``(n,)`` random ordinary token ids (no image or special tokens)."""
    vocab = engine.backend.adapter.image_token_id
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, min(vocab, 500), (n,), generator=g)


@torch.no_grad()
def _vlkv_steps(engine, prompt: torch.Tensor, continuation: torch.Tensor, policy):
    """vlkv's teacher-forced loop; per step the logits ``(V,)`` and per layer (positions, K, V)."""
    n = prompt.numel()
    text = torch.full((n,), int(Modality.TEXT), dtype=torch.int8)
    batch = collate([EncodedPrompt(prompt, torch.arange(n)[:, None], text, {}, Spans(n, []))], engine.pad_id)
    cache = engine.new_cache(batch)
    out = engine.prefill(batch, policy, cache)
    steps = []
    for t in range(continuation.numel()):
        if t > 0:
            out = engine.decode(continuation[t - 1 : t], batch, policy, cache, t)
        layers = []
        for layer in cache.layers:
            length = int(layer.lengths[0])
            k, v = layer.attention_kv()
            # a copy: the cache edits its tables in place (appends, cuts)
            layers.append((layer.positions[0, 0, :length, 0].clone(), k[0, :, :length], v[0, :, :length]))
        steps.append((out.logits[0].float(), layers))
    return steps


# (prompt length, distance): the fixed point n - f + distance must be >= start for the reference's
# slicing to mean what vlkv's clamp means (a negative P indexes from the end in the authors' code)
SIZES = [(33, -2), (81, -5), (300, -25)]


@pytest.mark.parametrize(("n", "distance"), SIZES)
@pytest.mark.parametrize("budget", [0.5, 0.25, 0.1])
@pytest.mark.parametrize("positions", ["original", "compacted"])
def test_elastic_equals_reference_per_layer_and_step(n, distance, budget, positions, engines, eager_lm):
    engine = engines["tiny-llava"]
    ids = _tokens(engine, n + STEPS, seed=n)
    prompt, continuation = ids[:n], ids[n:]
    ref = run_reference(
        eager_lm, prompt, continuation, 1 - budget, positions, quirks=False, keep_kv=True, distance=distance
    )
    policy = make_policy("elastic", budget=budget, positions=positions, distance=distance)
    ours = _vlkv_steps(engine, prompt, continuation, policy)
    for t, ((logits, layers), r) in enumerate(zip(ours, ref)):
        for layer, ((pos, k, v), r_pos, (r_k, r_v)) in enumerate(zip(layers, r.layer_pos, r.kv)):
            where = f"step {t}, layer {layer}"
            assert pos.tolist() == r_pos.tolist(), f"kept entries differ at {where}"
            torch.testing.assert_close(k, r_k[0].float(), rtol=1e-4, atol=1e-4, msg=f"keys at {where}")
            torch.testing.assert_close(v, r_v[0].float(), rtol=1e-4, atol=1e-4, msg=f"values at {where}")
        torch.testing.assert_close(logits, r.logits, rtol=1e-4, atol=1e-4, msg=f"logits at step {t}")


def test_reference_code_selection_is_argsort_positions():
    """The port's ``quirks`` mode is the authors' selection: argsort positions, thrown not offset."""
    s = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7, 0.2])  # candidate scores, start = 1
    f = 2
    anchors, thrown = ReferenceElastic(0.5, quirks=True)._select(s, f, n=8)
    order = torch.argsort(s)  # [1, 5, 3, 0, 4, 2]
    assert anchors.tolist() == (torch.where(order > f)[0] + 1).tolist() == [2, 3, 5]
    # slot 0 (BOS) is averaged into an anchor; slots 3 and 5 are anchors *and* thrown (into themselves)
    assert thrown.tolist() == torch.where(order <= f)[0].tolist() == [0, 3, 5]
    anchors, thrown = ReferenceElastic(0.5, quirks=False)._select(s, f, n=8)
    assert anchors.tolist() == [1, 3, 5]  # top-3 of C = slots 1..6 by score: 0.9, 0.7, 0.5
    assert thrown.tolist() == [2, 4, 6]
