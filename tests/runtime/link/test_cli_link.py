"""`vlkv generate --link`: the JSON report says what was reused; bad link settings are one line."""

from __future__ import annotations

import json

import pytest

from vlkv.cli import main


def test_json_reports_store_hits_and_ttft(tmp_path, capsys):
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        json.dumps({"prompt": "What is it?", "images": ["builtin:noise"]})
        + "\n"
        + json.dumps({"prompt": "Again, shorter?", "images": ["builtin:noise"]})
        + "\n"
    )
    code = main(
        ["generate", "--model", "tiny-llava", "--policy", "full", "--batch-file", str(batch), "--link", "mpic",
         "--link-k", "2", "--max-new-tokens", "3", "--json"]
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    store = report["extras"]["store"]
    assert (store["hits"], store["misses"], store["corrupt"]) == (1, 1, 0)
    assert store["reused_tokens"] > 0 and len(report["extras"]["ttft_s"]) == 2


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--link", "blend"], "unknown link method 'blend'"),
        (["--link", "mpic", "--link-k", "-1"], "link k must be an integer >= 0"),
        (["--link", "cacheblend", "--link-r", "2"], "link r must be a fraction in [0, 1]"),
        (["--link", "cacheblend", "--link-deviation", "q"], "link deviation must be one of k, v"),
        (["--link", "mpic", "--store-budget", "0"], "store budget must be a fraction in (0, 1]"),
        (["--link", "mpic", "--store-budget", "0.5", "--store-scorer", "x"], "unknown record scorer 'x'"),
        (
            ["--link", "mpic", "--policy", "avl", "--set", "prefill_keep=0.5"],
            "drops prompt rows inside the prefill",
        ),
    ],
)
def test_bad_link_settings_exit_2_with_one_line(argv, needle, capsys):
    code = main(["generate", "--model", "tiny-llava", "--max-new-tokens", "2", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and needle in err, err


def test_generate_with_a_store_then_vlkv_store_lists_the_record(tmp_path, capsys):
    args = ["generate", "--model", "tiny-llava", "--policy", "full", "--link", "mpic", "--link-k", "2"]
    args += ["--store", str(tmp_path), "--tenant", "alice", "--max-new-tokens", "2", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["extras"]["store"]["misses"] == 1
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["extras"]["store"]["hits"] == 1
    assert main(["store", "ls", "--store", str(tmp_path), "--tenant", "alice"]) == 0
    listing = capsys.readouterr().out
    assert "alice" in listing and len(listing.strip().splitlines()) == 2  # header + one record
    assert main(["generate", "--model", "tiny-llava", "--store", str(tmp_path), "--max-new-tokens", "2"]) == 2
    assert "--store needs --link" in capsys.readouterr().err


def test_generate_links_with_cacheblend_and_reports_the_recomputed_rows(tmp_path, capsys):
    batch = tmp_path / "b.jsonl"
    rows = [
        {"prompt": "What is it?", "images": ["builtin:noise"]},
        {"prompt": "Again?", "images": ["builtin:noise"]},
    ]
    batch.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reports = {}
    for r in ("0", "0.5"):
        code = main(
            ["generate", "--model", "tiny-llava", "--policy", "full", "--batch-file", str(batch), "--link",
             "cacheblend", "--link-r", r, "--max-new-tokens", "2", "--json"]
        )  # fmt: skip
        assert code == 0
        reports[r] = json.loads(capsys.readouterr().out)["extras"]["store"]
    assert reports["0"]["hits"] == reports["0.5"]["hits"] == 1
    image = reports["0"]["reused_tokens"]  # r = 0: the whole stored image is reused
    assert reports["0.5"]["reused_tokens"] == image - int(0.5 * image)


def test_a_store_budget_writes_compressed_records(tmp_path, capsys):
    args = [
        "generate",
        "--model",
        "tiny-llava",
        "--policy",
        "full",
        "--link",
        "full-reuse",
        "--store-budget",
        "0.5",
    ]
    args += ["--store", str(tmp_path), "--max-new-tokens", "2", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["extras"]["store"]["misses"] == 1
    assert main(args) == 0
    store = json.loads(capsys.readouterr().out)["extras"]["store"]
    assert store["hits"] == 1 and store["reused_tokens"] == store["dropped_tokens"] > 0  # half of the image


def test_link_pick_reaches_the_linker_and_a_bad_pick_is_refused(tmp_path, capsys, monkeypatch):
    """`--link-pick ramp` spends the same recompute budget as MPIC's first-k, spread over the pictures:
    the linker sees the pick, the rows it recomputes differ, the reused count does not."""
    from vlkv.runtime.link import linker, picks

    seen = []

    def spy(engine, batch, emb, hits, spec):
        rows = picks.recompute_rows(engine, batch, emb, hits, spec)
        seen.append((spec.pick, rows.tolist()))
        return rows

    monkeypatch.setattr(linker, "recompute_rows", spy)
    batch = tmp_path / "b.jsonl"
    row = {"prompt": "Which is brighter?", "images": ["builtin:checkerboard", "builtin:gradient"]}
    batch.write_text(json.dumps(row) + "\n" + json.dumps(row | {"prompt": "And now?"}) + "\n")
    reused = {}
    for pick in ("first", "ramp"):
        code = main(
            ["generate", "--model", "tiny-llava", "--policy", "full", "--batch-file", str(batch), "--link", "mpic",
             "--link-k", "4", "--link-pick", pick, "--max-new-tokens", "2", "--json"]
        )  # fmt: skip
        assert code == 0
        store = json.loads(capsys.readouterr().out)["extras"]["store"]
        assert store["hits"] == 2, store
        reused[pick] = store["reused_tokens"]
    linked = {pick: rows for pick, rows in seen if rows}
    assert set(linked) == {"first", "ramp"}
    assert len(linked["first"]) == len(linked["ramp"]) == 8 and linked["first"] != linked["ramp"]
    assert reused["first"] == reused["ramp"] > 0
    with pytest.raises(SystemExit) as exit_:  # argparse's refusal of a choice it does not know
        main(["generate", "--model", "tiny-llava", "--link", "mpic", "--link-pick", "last"])
    assert exit_.value.code == 2 and "invalid choice: 'last'" in capsys.readouterr().err


def test_link_check_measures_the_ramp_pick_and_saves_it_as_its_own_check(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLKV_CACHE", str(tmp_path))
    base = [
        "link-check",
        "--model",
        "tiny-llava",
        "--link",
        "mpic",
        "--link-k",
        "4",
        "--tokens",
        "4",
        "--json",
    ]
    assert main([*base, "--link-pick", "ramp"]) == 0
    out = capsys.readouterr()
    check = json.loads(out.out)
    assert check["pick"] == "ramp" and 0.0 <= check["agreement"] <= 1.0 and check["probes"] >= 1
    assert "mpic-ramp-4" in out.err
    saved = sorted(p.name for p in (tmp_path / "link-checks").rglob("*") if p.is_file())
    assert len(saved) == 1 and "ramp" in saved[0], saved


def test_generate_and_link_check_read_the_same_link_flags():
    from vlkv.cli import build_parser
    from vlkv.link_cli import link_spec

    flags = ["--link", "mpic", "--link-k", "8", "--link-pick", "ramp", "--store-budget", "0.5"]
    parser = build_parser()
    gen, check = (link_spec(parser.parse_args([cmd, *flags])) for cmd in ("generate", "link-check"))
    assert gen == check and (gen.k, gen.pick, gen.store_budget) == (8, "ramp", 0.5)
    assert gen.label == "mpic-ramp-8 (records at 0.5, keynorm)"
    # --link-k left out: generate reads None ("no k asked"), link-check MPIC's 32; both build k = 32
    gen, check = (parser.parse_args([cmd, "--link", "mpic"]) for cmd in ("generate", "link-check"))
    assert (gen.link_k, check.link_k) == (None, 32) and link_spec(gen) == link_spec(check)
