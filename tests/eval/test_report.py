import json

import pytest

from vlkv.eval.report import markdown_table, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records():
    recs = []
    for policy, base in [("full", 10.0), ("h2o", 11.0), ("elastic", 10.5)]:
        for budget in (0.1, 0.5, 1.0):
            for ctx in (512, 2048):
                recs.append(
                    {
                        "policy": policy,
                        "budget": budget,
                        "machine": "cpu-2core",
                        "context_length": ctx,
                        "ppl": base / budget**0.1,
                        "rouge_l": budget,
                        "decode_s": 0.01 * ctx,
                        "decode_speed_ratio": 1.0 / budget,
                    }
                )
    return recs


def test_write_report_produces_table_json_and_plots(tmp_path):
    report = write_report(_records(), root=tmp_path, date="2026-11-21")
    assert report.out_dir == tmp_path / "2026-11-21-cpu-2core"
    text = report.table.read_text()
    assert text.startswith("# vlkv benchmark")
    assert "| policy | budget | context_length | ppl | rouge_l | decode_s | decode_speed_ratio |" in text
    assert text.count("\n| ") == 1 + 18  # header + one row per record
    assert "| elastic | 0.1 | 512 |" in text
    assert json.loads(report.records.read_text()) == _records()
    names = [p.name for p in report.plots]
    # decode_s is a timing: in the table but not plotted as quality.
    assert names == ["quality-ppl.png", "quality-rouge_l.png", "speed-decode_speed_ratio.png"]
    for p in report.plots:
        assert p.read_bytes()[:8] == PNG_MAGIC
        assert p.stat().st_size > 5000


def test_a_rerun_never_overwrites_an_earlier_report(tmp_path):
    first = write_report(_records(), root=tmp_path, date="2026-11-21")
    fewer = [r for r in _records() if r["policy"] == "h2o"][:2]
    second = write_report(fewer, root=tmp_path, date="2026-11-21")
    third = write_report(fewer, root=tmp_path, date="2026-11-21")
    assert first.out_dir == tmp_path / "2026-11-21-cpu-2core"
    assert (second.out_dir.name, third.out_dir.name) == ("2026-11-21-cpu-2core-r2", "2026-11-21-cpu-2core-r3")
    assert json.loads(first.records.read_text()) == _records()  # all 18 records kept
    assert len(json.loads(second.records.read_text())) == 2
    for rep in (first, second):  # every folder's plots are exactly its own
        assert sorted(p.name for p in rep.out_dir.glob("*.png")) == sorted(p.name for p in rep.plots)


def test_rewriting_a_run_drops_stale_plots_and_refuses_to_lose_records(tmp_path):
    recs = [{"policy": "a", "budget": 0.5, "machine": "m", "ppl": 2.0, "x_ratio": 1.0, "context_length": 8}]
    rep = write_report(recs, root=tmp_path, date="2026-11-21")
    assert {p.name for p in rep.plots} == {"quality-ppl.png", "speed-x_ratio.png"}
    more = [{**recs[0], "x_ratio": None}, {"policy": "b", "budget": 0.5, "machine": "m", "ppl": 3.0}]
    again = write_report(more, root=tmp_path, date="2026-11-21", into=rep.out_dir)
    assert again.out_dir == rep.out_dir and sorted(p.name for p in rep.out_dir.glob("*.png")) == [
        "quality-ppl.png"
    ]
    with pytest.raises(ValueError, match="superset"):
        write_report(more[:1], root=tmp_path, into=rep.out_dir)


def test_write_report_validates(tmp_path):
    with pytest.raises(ValueError, match="several machines"):
        write_report([*_records(), {"policy": "x", "budget": 0.5, "machine": "h100"}], root=tmp_path)
    with pytest.raises(ValueError, match="budget"):
        write_report([{"policy": "x", "budget": 0.0, "machine": "m"}], root=tmp_path)
    with pytest.raises(ValueError, match="required key"):
        write_report([{"policy": "x", "budget": 0.5}], root=tmp_path)
    with pytest.raises(ValueError, match="date"):
        write_report(_records(), root=tmp_path, date="21/11/2026")
    with pytest.raises(ValueError, match="non-empty"):
        write_report([], root=tmp_path)


def test_markdown_table_blank_cells_and_sorting():
    table = markdown_table(
        [
            {"policy": "b", "budget": 0.5, "machine": "m", "ppl": 3.14159},
            {"policy": "a", "budget": 0.2, "machine": "m", "kl": 0.5, "note": "x|y"},
        ]
    )
    lines = table.splitlines()
    assert lines[0] == "| policy | budget | ppl | kl | note |"
    assert lines[2] == "| a | 0.2 |  | 0.5 | x\\|y |"
    assert lines[3] == "| b | 0.5 | 3.142 |  |  |"
