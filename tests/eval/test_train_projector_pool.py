"""scripts/train_projector.py --pool 2 on the tiny LLaVA: the ridge fit is per pooled token, the pool is
in the checkpoint, the resumed run and the exported file; an unpooled projector may start a pooled run,
not the reverse; the VQA runner installs a pooled file and matches the processor to it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.eval.train_script import check_plain_starts_a_form_run
from tests.eval.train_script import tiny_cfg as _cfg
from vlkv.runtime.models.projector_pool import POOL_KEY, PooledProjector

POOLED = 4  # tiny-llava: a 4x4 patch raster, 2x2 pooled


def test_pooled_run_fits_per_token_resumes_and_exports_its_pool(tp, tmp_path):
    from safetensors.torch import load_file

    cfg = _cfg(tp, pool=2, init_target="local")
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    assert straight[POOL_KEY].dtype == torch.int64 and int(straight[POOL_KEY]) == 2
    init = json.loads((tmp_path / "a" / tp.LOG).read_text().splitlines()[0])
    # 3 images x 4 pooled tokens: the fit has 12 rows, so at most 12 directions (unpooled: 48 rows)
    assert init["event"] == "init" and init["rank"] == 3 * POOLED
    tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    # the same batches unpooled train other weights: the pooling reaches the LM loss
    plain = tp.train(_cfg(tp, init_target="local"), tmp_path / "p", quiet=True)
    assert POOL_KEY not in plain
    assert not torch.equal(plain["linear_2.weight"], straight["linear_2.weight"])
    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    exported = load_file(tmp_path / "a.safetensors")
    assert exported[POOL_KEY].dtype == torch.int64 and int(exported[POOL_KEY]) == 2
    torch.testing.assert_close(exported["linear_2.weight"], straight["linear_2.weight"], rtol=0, atol=0)


def test_an_unpooled_projector_starts_a_pooled_run_not_the_reverse(tp, tmp_path):
    check_plain_starts_a_form_run(tp, tmp_path, {"pool": 2}, POOL_KEY, "is pooled by 2, not 1")
    with pytest.raises(ValueError, match="pool must be one of"):
        _cfg(tp, pool=3)
    for bad in ({"form": "linear"}, {"position_bias": "thirds"}, {"token_order": "columns"}):
        with pytest.raises(ValueError, match="pool 2 needs form mlp, no position_bias and raster order"):
            _cfg(tp, pool=2, **bad)


def test_vqa_swaps_in_a_pooled_projector_and_its_token_count(tp, tmp_path):
    from PIL import Image

    from vlkv.eval.vqa import _swap_projector
    from vlkv.runtime.models import smollm2_llava as S

    tp.train(_cfg(tp, steps=1, pool=2), tmp_path / "a", quiet=True)
    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    for path in (tmp_path / "a.safetensors", tmp_path / "a" / tp.CHECKPOINT):
        loaded = tp.load("tiny-llava")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(S, "NUM_IMAGE_TOKENS", 16)
            _swap_projector(loaded, path)
        assert isinstance(loaded.model.model.multi_modal_projector, PooledProjector)
        prompt = loaded.prompt_template("hi", 1)
        inputs = loaded.processor(text=prompt, images=[Image.new("RGB", (56, 56))], return_tensors="pt")
        assert int((inputs["input_ids"] == loaded.image_token_id).sum()) == POOLED


def test_cli_refuses_a_bad_pool_in_one_line(tp, tmp_path, capsys):
    assert tp.main(["--out", str(tmp_path), "--model", "tiny-llava", "--pool", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pool must be one of" in err


def test_a_shipped_safetensors_file_starts_a_run_as_its_checkpoint_would(tp, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tp.train(_cfg(tp, steps=1, pool=2), tmp_path / "a", quiet=True)
    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    shipped = load_file(tmp_path / "a.safetensors")
    cfg = _cfg(tp, pool=2, init_from=str(tmp_path / "a.safetensors"))
    tp.train(cfg, tmp_path / "s", stop_at=0, quiet=True)
    start = torch.load(tmp_path / "s" / tp.CHECKPOINT, weights_only=False)["projector"]
    assert start.keys() == shipped.keys()
    for key in shipped:
        torch.testing.assert_close(start[key], shipped[key], rtol=0, atol=0)
    # continued from the file or from the checkpoint it was exported from: the same weights
    from_file = tp.train(cfg, tmp_path / "s", resume=True, quiet=True)
    from_ckpt = tp.train(
        _cfg(tp, pool=2, init_from=str(tmp_path / "a" / tp.CHECKPOINT)), tmp_path / "c", quiet=True
    )
    for key in from_ckpt:
        torch.testing.assert_close(from_file[key], from_ckpt[key], rtol=0, atol=0)
    # a file named relative to the working directory is named by itself in the export's settings
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        tp.train(_cfg(tp, pool=2, init_from="a.safetensors"), tmp_path / "r", stop_at=0, quiet=True)
    tp.export(tmp_path / "r", tmp_path / "r.safetensors")
    with safe_open(tmp_path / "r.safetensors", "pt") as f:
        assert json.loads(f.metadata()["config"])["init_from"] == "a.safetensors"
    # folded LM adapters are not a run's form: refused in one line naming the file
    save_file(shipped | {"lm_lora.layer.B": torch.zeros(2, 2)}, tmp_path / "lora.safetensors")
    with pytest.raises(ValueError, match="lora.safetensors holds folded LM adapters"):
        tp.train(_cfg(tp, pool=2, init_from=str(tmp_path / "lora.safetensors")), tmp_path / "l", quiet=True)
