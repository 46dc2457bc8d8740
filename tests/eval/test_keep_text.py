"""``--keep-text`` (:mod:`vlkv.eval.keep_text`): KL(base LM || adapted LM) on plain text, the base being the
same model with its adapters off. The term is 0 with zero or disabled adapters and positive otherwise,
its gradient reaches only the adapters, a run with it resumes bit for bit, and a run without it draws
and trains exactly as before the option existed."""

from __future__ import annotations

import json

import pytest
import torch

from tests.eval.train_script import tiny_cfg
from tests.runtime.models.test_smollm2_llava import PARAGRAPH
from vlkv.eval import keep_text
from vlkv.runtime.models import lm_lora


def _cfg(tp, **kw):
    return tiny_cfg(tp, **{"lm_lora_rank": 2, "lm_lora_targets": "q_proj,o_proj"} | kw)


@pytest.fixture
def adapted(tp):
    """tiny-llava with rank-2 adapters on q/o (``B`` zero, as attached) and its adapter parameters."""
    loaded = tp.load("tiny-llava")
    params = lm_lora.attach(loaded.model, 2, ("q_proj", "o_proj"), 16.0, 0)
    return loaded, params


def test_kl_is_zero_without_adapter_change_and_positive_with_it(tp, adapted):
    loaded, params = adapted
    text = keep_text.items(loaded, 0, 0, 1)[0]
    assert keep_text.kl_to_base(loaded, text).item() == 0.0  # B = 0: the adapted model is the base
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params[1::2]:  # every B
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    kl = keep_text.kl_to_base(loaded, text)
    assert kl.item() > 1e-6
    kl.backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in params)
    assert all(not p.requires_grad for n, p in loaded.model.named_parameters() if ".base." in n)
    with lm_lora.disabled(loaded.model):  # adapters off: the base model's own logits, bit for bit
        assert keep_text.kl_to_base(loaded, text).item() == 0.0
        ids = torch.randint(0, 200, (1, 12), generator=gen)
        with torch.no_grad():
            off = loaded.model(input_ids=ids, use_cache=False).logits
    plain = tp.load("tiny-llava")
    with torch.no_grad():
        want = plain.model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(off, want, rtol=0, atol=0)
    assert all(m.enabled for m in lm_lora.adapters(loaded.model).values())  # back on after the block


def test_items_are_seeded_alternate_kinds_and_leave_the_checks_out(tp):
    loaded = tp.load("tiny-llava")
    first = keep_text.items(loaded, 0, 5, 4)
    assert first == keep_text.items(loaded, 0, 5, 4)  # a resume draws the same
    assert first != keep_text.items(loaded, 0, 6, 4) or first != keep_text.items(loaded, 1, 5, 4)
    eos = loaded.processor.tokenizer.eos_token
    assert [t.endswith(eos) for t in first] == [True, False, True, False]  # chat, prose, chat, prose
    assert all(t in keep_text.prose() for t in first[1::2])
    everything = " ".join(keep_text.prose()) + " ".join(q + r for q, r in keep_text.CHAT)
    assert "capital" not in everything.lower() and "lighthouse" not in everything.lower()
    assert PARAGRAPH[:40] not in everything
    assert len(keep_text.prose()) >= 20
    with pytest.raises(ValueError, match="items per step must be >= 1"):
        keep_text.items(loaded, 0, 0, 0)


def test_keep_text_moves_the_adapters_and_resumes_bit_for_bit(tp, tmp_path):
    plain = tp.train(_cfg(tp, steps=3), tmp_path / "plain", quiet=True)
    cfg = _cfg(tp, steps=3, keep_text=1.0, keep_text_items=2)
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    tp.train(cfg, tmp_path / "b", stop_at=1, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    a, b, p = (
        torch.load(d / tp.CHECKPOINT, weights_only=False)["lm_lora"]
        for d in (tmp_path / "a", tmp_path / "b", tmp_path / "plain")
    )
    for key, value in b.items():
        torch.testing.assert_close(value, a[key], rtol=0, atol=0)
    assert any(not torch.equal(a[k], p[k]) for k in p)  # the term changed the adapters' training
    logged = [json.loads(line) for line in (tmp_path / "a" / tp.LOG).read_text().splitlines()]
    kept = [r["keep_text"] for r in logged if "step" in r and "keep_text" in r]
    assert len(kept) == 3 and kept[0] == 0.0 and kept[-1] > 0  # B starts at zero: no KL at step 0
    assert set(plain) == set(straight)


def test_keep_text_zero_draws_and_trains_as_before(tp, tmp_path, monkeypatch):
    """Off, the option touches nothing: no item is drawn, no KL is run, the batches and text forms are
    those of the same config with keep_text on, and a checkpoint written without the settings resumes."""

    def refuse(*args, **kwargs):
        raise AssertionError("keep_text 0 must not draw or run the keep-text term")

    cfg = _cfg(tp, steps=3, text_mix=0.5)
    on = _cfg(tp, steps=3, text_mix=0.5, keep_text=0.5)
    for step in range(3):
        assert tp.batch_for(step, cfg) == tp.batch_for(step, on)
    with monkeypatch.context() as mp:
        mp.setattr(keep_text, "items", refuse)
        mp.setattr(keep_text, "kl_to_base", refuse)
        straight = tp.train(cfg, tmp_path / "a", quiet=True)
        tp.train(cfg, tmp_path / "b", stop_at=1, quiet=True)
        ckpt_path = tmp_path / "b" / tp.CHECKPOINT
        ckpt = torch.load(ckpt_path, weights_only=False)
        for name in ("keep_text", "keep_text_items"):  # as a checkpoint from before the option
            del ckpt["config"][name]
        torch.save(ckpt, ckpt_path)
        resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    logged = [json.loads(line) for line in (tmp_path / "a" / tp.LOG).read_text().splitlines()]
    assert all("keep_text" not in r for r in logged)


def test_bad_keep_text_settings_are_refused(tp):
    with pytest.raises(ValueError, match="needs lm_lora_rank"):
        tiny_cfg(tp, keep_text=1.0)
    with pytest.raises(ValueError, match="keep_text must be >= 0"):
        _cfg(tp, keep_text=-1.0)
    with pytest.raises(ValueError, match="keep_text_items >= 1"):
        _cfg(tp, keep_text=1.0, keep_text_items=0)
