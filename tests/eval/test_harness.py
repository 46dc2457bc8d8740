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
    assert full["decode_ratio"] == 1.0 and full["peak_kv_ratio"] == 1.0 and full["held_kv_ratio"] == 1.0
    assert full["stats_overhead_ratio"] == 1.0  # full asks no statistics
    for r in speed:
        # the peak is sampled before the edits: never below what the cache holds after them
        assert r["peak_kv_bytes"] >= r["held_kv_bytes"] >= r["final_kv_bytes"] > 0
        assert r["meta_bytes"] > 0 and r["max_rss_mib"] > 0
    assert all(r["held_kv_ratio"] < 1 for r in speed if r["policy"] != "full")
    assert all(r["stats_overhead_ratio"] != 1.0 for r in speed if r["policy"] != "full")  # measured per row
    text = (folder / "results.md").read_text()
    assert "## quality" in text and "## speed" in text
    assert (folder / "quality-kl_mean.png").stat().st_size > 0
    assert (folder / "speed-decode_ratio.png").stat().st_size > 0


def test_rerun_same_day_keeps_the_earlier_report(tmp_path):
    args = ["--smoke", "--no-speed", "--out", str(tmp_path)]
    assert main(args) == 0
    assert main([*args, "--policies", "h2o"]) == 0
    first, second = sorted(tmp_path.iterdir())
    assert second.name == first.name + "-r2"
    assert len(json.loads((first / "results.json").read_text())) == 4  # 2 policies x 2 budgets
    assert len(json.loads((second / "results.json").read_text())) == 2
    for folder in (first, second):
        plotted = {p.name for p in folder.glob("*.png")}
        assert plotted and all(p.startswith("quality-") for p in plotted)


def test_named_configuration_runs_the_avl_paper_setting():
    from vlkv.eval.harness import make_config

    p = make_config("avl-paper", 0.45)
    assert (p.name, p.interval, p.prefill_keep) == ("avl", 3, 0.9)
    assert p.core_share == pytest.approx(0.30) and p.secondary_share == 0.45
    assert make_config("avl-paper", 1.0).core_share == 1.0  # budget 1 stays exact


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
