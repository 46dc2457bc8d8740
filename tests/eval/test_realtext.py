"""The real-text comparison runner: specs, resumable storage, report with intervals."""

from __future__ import annotations

import json

import pytest
import torch

from vlkv.eval.continuation import text_windows
from vlkv.eval.corpus import paragraphs
from vlkv.eval.realtext import parse_spec, report, run_side, write_report


def test_parse_spec():
    assert parse_spec("snapkv:window=64,kernel=5") == ("snapkv", {"window": 64, "kernel": 5})
    assert parse_spec("pyramidkv:fallback=true,beta=2.5") == ("pyramidkv", {"fallback": True, "beta": 2.5})
    assert parse_spec("h2o") == ("h2o", {})
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("snapkv:window")


def test_run_side_resumes_and_reports_intervals(engines, tmp_path):
    engine = engines["tiny-llava"]
    tok = engine.tokenizer
    text = " ".join(paragraphs())
    windows = text_windows(lambda s: tok(s, add_special_tokens=False)["input_ids"], [("c", text)], 3, 64, 8)
    specs = ["snapkv:window=8,kernel=5", "local"]
    logs = []
    run_side("vlkv", engine, windows, specs, [0.5, 0.25], tmp_path, batch_size=2, log=logs.append)
    assert len(logs) == 5 and (tmp_path / "nll" / "vlkv" / "full@1.pt").is_file()
    run_side("vlkv", engine, windows, specs, [0.5, 0.25], tmp_path, log=logs.append)
    assert len(logs) == 5  # everything stored: nothing re-measured
    # a fake peer row on the same windows: the comparison table appears
    snap = torch.load(tmp_path / "nll" / "vlkv" / "snapkv_window=8,kernel=5@0.5.pt", weights_only=False)
    peer = {**snap, "side": "kvpress", "spec": "snapkv:window_size=8", "label": "snapkv:window_size=8@0.5"}
    peer["nll"] = snap["nll"] + 0.05
    (tmp_path / "nll" / "kvpress").mkdir()
    torch.save(peer, tmp_path / "nll" / "kvpress" / "snap@0.5.pt")
    md, records = report(tmp_path, n_boot=200)
    assert "| vlkv | `full` | 1 |" in md and "+0.00% [+0.00, +0.00]" in md
    (cmp,) = [r for r in records if r["side"] == "compare"]
    assert cmp["budget"] == 0.5 and cmp["delta"] < 0 and cmp["lo"] <= cmp["delta"] <= cmp["hi"]
    rows = {(r["side"], r["label"]): r for r in records if r["side"] != "compare"}
    assert rows[("vlkv", "local@0.25")]["kv_bytes"] < rows[("vlkv", "full@1")]["kv_bytes"]
    path = write_report(tmp_path, "# head\n", n_boot=200)
    assert path.read_text().startswith("# head\n") and json.loads((tmp_path / "results.json").read_text())
    raw = json.loads((tmp_path / "per_window.json").read_text())
    assert raw["tokens_per_window"] == 8 and len(raw["windows"]) == 3
    assert raw["window_mean_nll"]["vlkv:full@1"] == pytest.approx(full_means(tmp_path), abs=1e-6)


def test_run_side_with_reference_adds_kl_and_top1(engines, tmp_path):
    """With a reference folder the full run writes the logits, every configuration carries KL and
    top-1 agreement, results stored without them are measured again, and the report shows them;
    the kvpress side refuses to start before the reference exists."""
    engine = engines["tiny-llava"]
    tok = engine.tokenizer
    text = " ".join(paragraphs())
    windows = text_windows(lambda s: tok(s, add_special_tokens=False)["input_ids"], [("c", text)], 2, 64, 8)
    logs = []
    run_side("vlkv", engine, windows, ["local"], [0.25], tmp_path, batch_size=2, log=logs.append)
    assert len(logs) == 2 and "KL" not in logs[-1]
    with pytest.raises(ValueError, match="run the vlkv side first"):
        run_side(
            "kvpress", engine, windows, ["streaming_llm"], [0.25], tmp_path, reference_dir=tmp_path / "r"
        )
    run_side(
        "vlkv", engine, windows, ["local"], [0.25], tmp_path, log=logs.append, reference_dir=tmp_path / "r"
    )
    assert len(logs) == 4 and "KL" in logs[-1]  # both stored without KL: measured again
    run_side(
        "vlkv", engine, windows, ["local"], [0.25], tmp_path, log=logs.append, reference_dir=tmp_path / "r"
    )
    assert len(logs) == 4
    md, records = report(tmp_path, n_boot=200)
    rows = {r["label"]: r for r in records}
    assert rows["full@1"]["kl"] == 0 and rows["full@1"]["top1"] == 1
    assert rows["local@0.25"]["kl"] > 0 and rows["local@0.25"]["kl_lo"] <= rows["local@0.25"]["kl"]
    assert "KL(full ‖ config)" in md and f"{rows['local@0.25']['top1']:.3f}" in md


def full_means(root):
    return (
        torch.load(root / "nll" / "vlkv" / "full@1.pt", weights_only=False)["nll"].double().mean(1).tolist()
    )


def test_dppl_plot_draws_the_measured_lines(tmp_path):
    from vlkv.eval.realtext import plot_dppl

    recs = [
        {"side": s, "spec": spec, "budget": b, "dppl": d, "dppl_lo": d - 0.01, "dppl_hi": d + 0.02}
        for s, spec in (("vlkv", "kvgrad:heads=adaptive"), ("kvpress", "kvzip"))
        for b, d in ((0.5, 0.01), (0.25, 0.05), (0.1, 0.2))
    ]
    path = plot_dppl(
        recs + [{"side": "vlkv", "spec": "full", "budget": 1.0, "dppl": 0.0}], tmp_path / "d.png"
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert plot_dppl([{**recs[0], "spec": "local"}], tmp_path / "none.png") is None
