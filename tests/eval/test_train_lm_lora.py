"""scripts/train_projector.py with LM adapters (--lm-lora-rank) on the tiny LLaVA: the adapters train,
a stopped-and-resumed run ends bit for bit where an uninterrupted one does, and the exported file
rebuilds the trained model (projector + merged adapters) through vqa's --projector path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.eval.train_script import tiny_cfg


def _cfg(tp, **kw):
    return tiny_cfg(tp, **{"lm_lora_rank": 2, "lm_lora_targets": "q_proj,o_proj"} | kw)


def _adapters(path):
    return torch.load(path, weights_only=False)["lm_lora"]


def test_adapters_train_resume_and_export(tp, tmp_path):
    from safetensors.torch import load_file

    from vlkv.eval.vqa import _swap_projector
    from vlkv.runtime.models import lm_lora
    from vlkv.runtime.models import smollm2_llava as S

    cfg = _cfg(tp)
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    lora = _adapters(tmp_path / "a" / tp.CHECKPOINT)
    assert lora and any(k.endswith(".B") and v.abs().max() > 0 for k, v in lora.items())  # B left zero
    tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    for key, value in _adapters(tmp_path / "b" / tp.CHECKPOINT).items():
        torch.testing.assert_close(value, lora[key], rtol=0, atol=0)

    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    shipped = load_file(tmp_path / "a.safetensors")
    assert {k for k in shipped if k.startswith(lm_lora.PREFIX)} == {lm_lora.PREFIX + k for k in lora}
    # the file rebuilds the trained model: same logits as the training modules
    trained = tp.load("tiny-llava")
    lm_lora.attach(trained.model, 2, ("q_proj", "o_proj"), cfg.lm_lora_alpha, 0)
    lm_lora.load_raw_state(trained.model, lora)
    S.apply_projector(trained.model, straight)
    for path in (tmp_path / "a.safetensors", tmp_path / "a" / tp.CHECKPOINT):
        rebuilt = tp.load("tiny-llava")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(S, "NUM_IMAGE_TOKENS", 16)
            _swap_projector(rebuilt, path)
        ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = trained.model(input_ids=ids, use_cache=False).logits
            got = rebuilt.model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_second_phase_keeps_the_adapters(tp, tmp_path):
    tp.train(_cfg(tp, steps=2), tmp_path / "a", quiet=True)
    first = _adapters(tmp_path / "a" / tp.CHECKPOINT)
    cfg = _cfg(tp, steps=1, init_from=str(tmp_path / "a" / tp.CHECKPOINT))
    tp.train(cfg, tmp_path / "b", stop_at=0, quiet=True)
    for key, value in _adapters(tmp_path / "b" / tp.CHECKPOINT).items():
        torch.testing.assert_close(value, first[key], rtol=0, atol=0)


def test_bad_adapter_settings_are_one_line(tp, tmp_path, capsys):
    assert tp.main(["--out", str(tmp_path), "--model", "tiny-llava", "--lm-lora-rank", "-1"]) == 2
    assert "lm_lora_rank must be >= 0" in capsys.readouterr().err
    assert tp.main(["--out", str(tmp_path), "--lm-lora-rank", "2", "--lm-lora-targets", "qproj"]) == 2
    assert "targets must be among" in capsys.readouterr().err


def test_projector_lr_scale_zero_trains_only_the_adapters(tp, tmp_path):
    cfg = _cfg(tp, steps=2, projector_lr_scale=0.0)
    tp.train(cfg, tmp_path / "a", stop_at=0, quiet=True)
    start = torch.load(tmp_path / "a" / tp.CHECKPOINT, weights_only=False)["projector"]
    end = tp.train(cfg, tmp_path / "a", resume=True, quiet=True)
    for key, value in start.items():
        torch.testing.assert_close(end[key], value, rtol=0, atol=0)
    lora = _adapters(tmp_path / "a" / tp.CHECKPOINT)
    assert any(k.endswith(".B") and v.abs().max() > 0 for k, v in lora.items())
    with pytest.raises(ValueError, match="projector_lr_scale must be >= 0"):
        _cfg(tp, projector_lr_scale=-1.0)


def test_anchor_and_adapters_are_refused_together(tp):
    with pytest.raises(ValueError, match="cannot be used with lm_lora_rank"):
        _cfg(tp, anchor=1.0)


@pytest.mark.demo
def test_vqa_records_which_projector_file_answered(tmp_path):
    """``python -m vlkv.eval.vqa --projector F --out J``: J names F and its sha256 (the shipped file
    here, swapped into the untouched LM: the same answers as the model as built), so a report's
    numbers can be traced to the weights."""
    import json

    from vlkv.eval import vqa
    from vlkv.runtime.models import smollm2_llava as S

    out = tmp_path / "vqa.json"
    args = ["--projector", str(S.PROJECTOR_FILE), "--n-single", "2", "--n-two", "0", "--n-multi", "0"]
    assert vqa.main(args + ["--groups", "single", "--threads", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["projector"] == {"file": S.PROJECTOR_FILE.name, "sha256": S.PROJECTOR_SHA256}
    built = tmp_path / "built.json"  # the model as built (shipped file, checksum verified): same answers
    assert vqa.main(args[2:] + ["--groups", "single", "--threads", "1", "--out", str(built)]) == 0
    answers = [[r["answer"] for r in json.loads(p.read_text())["results"][0]["rows"]] for p in (out, built)]
    assert answers[0] == answers[1] and len(answers[0]) == 2
    assert "projector" not in json.loads(built.read_text())


def test_text_mix_and_distill_train_and_resume_bit_for_bit(tp, tmp_path):
    """Stage 2: text samples and the distillation term change the run, and it still resumes exactly."""
    plain = tp.train(_cfg(tp, steps=3), tmp_path / "plain", quiet=True)
    cfg = _cfg(tp, steps=3, text_mix=0.5, distill=0.5, distill_hidden=0.5)
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    tp.train(cfg, tmp_path / "b", stop_at=1, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    a, b = _adapters(tmp_path / "a" / tp.CHECKPOINT), _adapters(tmp_path / "b" / tp.CHECKPOINT)
    for key, value in b.items():
        torch.testing.assert_close(value, a[key], rtol=0, atol=0)
    assert any(not torch.equal(straight[k], plain[k]) for k in plain)  # the new terms moved the run
    with pytest.raises(ValueError, match="text_mix trains the LM adapters"):
        tiny_cfg(tp, text_mix=0.5)


def test_a_text_sample_is_the_description_and_the_same_answer(tp):
    from vlkv.eval.scene_tasks import two_turns

    loaded = tp.load("tiny-llava")
    sample = two_turns(np.random.default_rng(0), "train")
    image, n_image = tp.encode(loaded, sample)
    text, n_text = tp.encode(loaded, sample, text_form="sides")
    assert "pixel_values" in image and "pixel_values" not in text
    # the answers' turns are the same tokens after either prompt
    assert torch.equal(image["input_ids"][0, n_image:], text["input_ids"][0, n_text:])
    assert torch.equal(image["answer_mask"][n_image:], text["answer_mask"][n_text:])
    prompt = loaded.processor.tokenizer.decode(text["input_ids"][0, :n_text])
    assert "on the left" in prompt and sample.question in prompt
