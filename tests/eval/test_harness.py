"""The measurement harness end to end on the tiny model (smoke mode), plus config validation."""

from __future__ import annotations

import json

import pytest

from vlkv.eval.harness import SweepConfig
from vlkv.eval.run import main


def test_smoke_report_end_to_end(tmp_path, capsys):
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    (folder,) = list(tmp_path.iterdir())
    records = json.loads((folder / "results.json").read_text())
    quality = {(r["policy"], r["budget"]): r for r in records if r["kind"] == "quality"}
    speed = [r for r in records if r["kind"] == "speed"]
    assert (
        quality[("h2o", 1.0)]["kl_mean"] == 0.0
        and quality[("elastic", 1.0)]["ppl"] == quality[("elastic", 1.0)]["full_ppl"]
    )
    assert quality[("elastic", 0.3)]["kl_mean"] > 0
    full = next(r for r in speed if r["policy"] == "full")
    assert full["decode_ratio"] == 1.0 and full["peak_kv_ratio"] == 1.0
    assert all(r["peak_kv_ratio"] < 1 for r in speed if r["policy"] != "full")
    text = (folder / "results.md").read_text()
    assert "## quality" in text and "## speed" in text
    assert (folder / "quality-kl_mean.png").stat().st_size > 0
    assert (folder / "speed-decode_ratio.png").stat().st_size > 0


@pytest.mark.parametrize(
    "kwargs,needle",
    [({"budgets": [0.0]}, "budgets must be in (0, 1]"), ({"new_tokens": 1}, "new_tokens must be >= 2")],
)
def test_sweep_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(
        ValueError,
        match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
    ):
        SweepConfig(**kwargs)


def test_bad_cli_value_is_one_line(capsys):
    assert main(["--smoke", "--budgets", "2"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
