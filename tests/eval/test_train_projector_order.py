"""scripts/train_projector.py --token-order columns on the tiny LLaVA: the order is in the checkpoint,
the resumed run and the exported file; a raster run's projector may start a columns run, not the
reverse; the VQA runner installs an ordered file."""

from __future__ import annotations

import pytest
import torch

from tests.eval.train_script import check_plain_starts_a_form_run
from tests.eval.train_script import tiny_cfg as _cfg
from vlkv.runtime.models.projector_order import ORDER_KEY, OrderedProjector, column_major


def test_columns_run_resumes_and_exports_its_order(tp, tmp_path):
    from safetensors.torch import load_file

    cfg = _cfg(tp, token_order="columns")
    straight = tp.train(cfg, tmp_path / "a", quiet=True)
    assert torch.equal(straight[ORDER_KEY], column_major(16))
    tp.train(cfg, tmp_path / "b", stop_at=2, quiet=True)
    resumed = tp.train(cfg, tmp_path / "b", resume=True, quiet=True)
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
    # the same batches in raster order train other weights: the order reaches the LM loss
    raster = tp.train(_cfg(tp), tmp_path / "r", quiet=True)
    assert ORDER_KEY not in raster
    assert not torch.equal(raster["linear_2.weight"], straight["linear_2.weight"])
    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    exported = load_file(tmp_path / "a.safetensors")
    assert exported[ORDER_KEY].dtype == torch.int64 and torch.equal(exported[ORDER_KEY], column_major(16))
    torch.testing.assert_close(exported["linear_2.weight"], straight["linear_2.weight"], rtol=0, atol=0)


def test_a_raster_projector_starts_a_columns_run_not_the_reverse(tp, tmp_path):
    check_plain_starts_a_form_run(
        tp, tmp_path, {"token_order": "columns"}, ORDER_KEY, "another image-token order than 'raster'"
    )
    with pytest.raises(ValueError, match="token_order must be one of"):
        _cfg(tp, token_order="rows")
    with pytest.raises(ValueError, match="needs form mlp and no position_bias"):
        _cfg(tp, token_order="columns", form="linear")
    with pytest.raises(ValueError, match="needs form mlp and no position_bias"):
        _cfg(tp, token_order="columns", position_bias="thirds")


def test_vqa_swaps_in_an_ordered_projector(tp, tmp_path):
    from vlkv.eval.vqa import _swap_projector
    from vlkv.runtime.models import smollm2_llava as S

    tp.train(_cfg(tp, steps=1, token_order="columns"), tmp_path / "a", quiet=True)
    tp.export(tmp_path / "a", tmp_path / "a.safetensors")
    for path in (tmp_path / "a.safetensors", tmp_path / "a" / tp.CHECKPOINT):
        loaded = tp.load("tiny-llava")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(S, "NUM_IMAGE_TOKENS", 16)
            _swap_projector(loaded, path)
        proj = loaded.model.model.multi_modal_projector
        assert isinstance(proj, OrderedProjector) and torch.equal(proj.token_order, column_major(16))


def test_cli_refuses_a_bad_order_in_one_line(tp, tmp_path, capsys):
    assert tp.main(["--out", str(tmp_path), "--model", "tiny-llava", "--token-order", "rows"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "token_order must be one of" in err
