"""Low-rank LM adapters (vlkv.runtime.models.lm_lora): the merged weights compute what the adapted
modules computed, a file's adapters reach the model through apply_projector, bad keys are one line,
and `disabled` runs the base model without a copy."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.models import lm_lora


@pytest.fixture()
def tiny():
    from vlkv.runtime.models.registry import load_model

    return load_model("tiny-llava")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _random_adapters(model, rank=4, seed=1):
    adapters = lm_lora.attach(model, rank, ("q_proj", "v_proj", "down_proj"), 8.0, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapters[1::2]:  # B starts at zero: give it something to add
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return adapters


def test_fresh_adapters_leave_the_model_unchanged(tiny):
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    before = _logits(tiny.model, ids)
    lm_lora.attach(tiny.model, 4, ("q_proj", "k_proj", "v_proj", "o_proj"), 8.0, 0)
    torch.testing.assert_close(_logits(tiny.model, ids), before, rtol=0, atol=0)


def test_merged_weights_equal_the_adapted_model(tiny):
    """attach → train-like random B → fold → merge into a fresh copy: same logits (fp32 sums)."""
    from vlkv.runtime.models.registry import load_model

    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = _logits(tiny.model, ids)
    _random_adapters(tiny.model)
    adapted = _logits(tiny.model, ids)
    assert (adapted - plain).abs().max() > 1e-3  # the adapters do something
    scale = 8.0 / 4
    folded = lm_lora.fold(lm_lora.raw_state(tiny.model), scale)
    assert all(k.startswith(lm_lora.PREFIX) for k in folded)
    fresh = load_model("tiny-llava")
    before = {n: p.detach().clone() for n, p in fresh.model.named_parameters()}
    assert lm_lora.merge(fresh.model, folded) == len(folded) // 2
    torch.testing.assert_close(_logits(fresh.model, ids), adapted, rtol=1e-5, atol=1e-5)
    changed = {n for n, p in fresh.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.split(".")[-2] in ("q_proj", "v_proj", "down_proj") for n in changed)


def test_raw_state_round_trips(tiny):
    from vlkv.runtime.models.registry import load_model

    _random_adapters(tiny.model)
    raw = lm_lora.raw_state(tiny.model)
    other = load_model("tiny-llava")
    lm_lora.attach(other.model, 4, ("q_proj", "v_proj", "down_proj"), 8.0, 7)
    lm_lora.load_raw_state(other.model, raw)
    for key, value in lm_lora.raw_state(other.model).items():
        torch.testing.assert_close(value, raw[key], rtol=0, atol=0)
    with pytest.raises(ValueError, match="other modules"):
        lm_lora.load_raw_state(other.model, {k: v for k, v in raw.items() if "q_proj" not in k})


@pytest.mark.parametrize(
    "key, shape, match",
    [
        ("lm_lora.0.q_proj.C", (2, 2), "is not lm_lora"),
        ("lm_lora.0.attn.A", (2, 2), "is not lm_lora"),
        ("lm_lora.99.q_proj.A", None, "existing layer"),
        ("lm_lora.0.q_proj.A", "wide", "do not fit"),
    ],
)
def test_bad_adapters_are_one_line(tiny, key, shape, match):
    w = tiny.model.model.language_model.layers[0].self_attn.q_proj.weight
    good = {
        "lm_lora.0.q_proj.A": torch.zeros(2, w.shape[1]),
        "lm_lora.0.q_proj.B": torch.zeros(w.shape[0], 2),
    }
    if shape is None:
        bad = {key: good["lm_lora.0.q_proj.A"], key[:-1] + "B": good["lm_lora.0.q_proj.B"]}
    elif shape == "wide":
        bad = good | {key: torch.zeros(2, w.shape[1] + 1)}
    else:
        bad = {key: torch.zeros(*shape)}
    with pytest.raises(ValueError, match=match) as err:
        lm_lora.merge(tiny.model, bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="targets must be among"):
        lm_lora.parse_targets("q_proj,attn")


def test_apply_projector_merges_a_files_adapters(tiny):
    """A projector file with lm_lora.* keys: the projector is installed and the adapters merged, the
    build cache's tensors are never written in place."""
    from vlkv.runtime.models import smollm2_llava as S

    proj = tiny.model.model.multi_modal_projector
    state = {k: v.clone() + 0.01 for k, v in proj.state_dict().items()}
    w = tiny.model.model.language_model.layers[1].self_attn.v_proj.weight
    old = w.detach().clone()
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, w.shape[1], generator=gen), torch.randn(w.shape[0], 2, generator=gen)
    S.apply_projector(tiny.model, state | {"lm_lora.1.v_proj.A": a, "lm_lora.1.v_proj.B": b})
    new = tiny.model.model.language_model.layers[1].self_attn.v_proj.weight
    torch.testing.assert_close(new, old + b @ a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w, old, rtol=0, atol=0)  # the old tensor is untouched
    for k, v in tiny.model.model.multi_modal_projector.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


def test_a_bad_adapter_leaves_the_model_as_it_was(tiny):
    """A file whose later adapter does not fit changes neither earlier weights nor the projector."""
    from vlkv.runtime.models import smollm2_llava as S

    before = {n: p.detach().clone() for n, p in tiny.model.named_parameters()}
    w = tiny.model.model.language_model.layers[0].self_attn.q_proj.weight
    good = {"lm_lora.0.q_proj.A": torch.ones(2, w.shape[1]), "lm_lora.0.q_proj.B": torch.ones(w.shape[0], 2)}
    bad = {
        "lm_lora.1.q_proj.A": torch.ones(2, w.shape[1] + 1),
        "lm_lora.1.q_proj.B": torch.ones(w.shape[0], 2),
    }
    proj = {k: v + 1.0 for k, v in tiny.model.model.multi_modal_projector.state_dict().items()}
    with pytest.raises(ValueError, match="do not fit"):
        lm_lora.merge(tiny.model, good | bad)
    with pytest.raises(ValueError, match="do not fit"):
        S.apply_projector(tiny.model, proj | good | bad)
    for name, value in tiny.model.named_parameters():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_disabled_runs_the_base_model_and_restores_the_adapters(tiny):
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    base = _logits(tiny.model, ids)
    _random_adapters(tiny.model)
    adapted = _logits(tiny.model, ids)
    assert not torch.equal(adapted, base)
    with lm_lora.disabled(tiny.model):
        torch.testing.assert_close(_logits(tiny.model, ids), base, rtol=0, atol=0)
        with lm_lora.disabled(tiny.model):  # nested: the outer block stays off after the inner one
            pass
        torch.testing.assert_close(_logits(tiny.model, ids), base, rtol=0, atol=0)
    torch.testing.assert_close(_logits(tiny.model, ids), adapted, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="boom"), lm_lora.disabled(tiny.model):
        raise RuntimeError("boom")
    torch.testing.assert_close(_logits(tiny.model, ids), adapted, rtol=0, atol=0)  # on again after an error
