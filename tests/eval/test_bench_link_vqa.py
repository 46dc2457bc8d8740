"""scripts/bench_link_vqa.py on the tiny LLaVA: every method answers every question, full recompute's
own methods agree with it exactly, and the report has one row per (image count, method)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_link_vqa.py"


@pytest.fixture(scope="module")
def blv():
    spec = importlib.util.spec_from_file_location("bench_link_vqa", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_questions_per_image_count(blv):
    for n_images in (1, 2, 5, 10):
        items = blv.items_for(n_images, 3, seed=0)
        assert len(items) == 3 and all(len(i.sample.scenes) == n_images for i in items)
    assert blv.items_for(1, 2, 0)[0].sample.question == "What is in the image?"


def test_methods_on_a_tiny_model(blv, loaded_models):
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.link.spec import LinkSpec
    from vlkv.runtime.prompt import Prompt

    engine = Engine(loaded_models["tiny-llava"])
    pool = engine.new_cache(engine.encode([Prompt("x")])).pool
    specs = [LinkSpec("none"), LinkSpec("prefix"), LinkSpec("full-reuse"), LinkSpec("mpic", 8)]
    item = blv.items_for(2, 1, seed=0)[0]
    rows = blv.measure_item(engine, pool, item, specs, tokens=6)
    assert list(rows) == ["none", "prefix", "full-reuse", "mpic-8"]
    assert rows["none"]["agreement"] == 1.0 and abs(rows["none"]["kl"]) < 1e-4
    assert rows["full-reuse"]["reused"] > 0 and rows["full-reuse"]["recomputed"] < rows["none"]["recomputed"]
    # the greedy answer of full recompute, scored as the VQA set scores it
    from vlkv.runtime.policies import make_policy

    full = engine.generate([Prompt(item.sample.question, item.images)], make_policy("full"), 10)
    assert rows["none"]["answer"] == blv.normalise(full.samples[0].text)
    # the reference path is engine.generate's greedy path
    batch = engine.encode([Prompt(item.sample.question, item.images)])
    cache = engine.new_cache(batch, pool=pool)
    ids, logps = blv.greedy_path(engine, batch, cache, engine.prefill(batch, make_policy("full"), cache), 6)
    cache.release()
    long = engine.generate(
        [Prompt(item.sample.question, item.images)], make_policy("full"), 6, stop_at_eos=False
    )
    assert ids == long.samples[0].token_ids and len(logps) == 6
    summary = blv.summarise([rows, rows])
    assert summary["mpic-8"]["n"] == 2 and 0 <= summary["mpic-8"]["accuracy"] <= 1
    assert summary["none"]["answer_match"] == 1.0 and summary["prefix"]["answer_match"] == 1.0
    same = {**rows, "mpic-8": {**rows["mpic-8"], "answer": rows["none"]["answer"]}}
    flipped = {**rows, "mpic-8": {**rows["mpic-8"], "answer": rows["none"]["answer"] + " not"}}
    assert blv.summarise([same, flipped])["mpic-8"]["answer_match"] == 0.5
    lines = blv.table({2: summary})
    assert len(lines) == 2 + 4 and "| 2 | mpic-8 | 2 |" in lines[-1]


def test_command_writes_the_report(blv, tmp_path, capsys):
    assert (
        blv.main(
            [
                "--model",
                "tiny-llava",
                "--images",
                "1",
                "--n",
                "1",
                "--k",
                "0",
                "--tokens",
                "3",
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "link-vqa.json").read_text())
    assert set(data["summary"]["1"]) == {"none", "prefix", "full-reuse", "cacheblend-0.15", "mpic-0"}
    assert "| 1 | mpic-0 | 1 |" in (tmp_path / "link-vqa.md").read_text()
    assert blv.main(["--model", "tiny-llava", "--images", "11"]) == 2
    assert "--images in 1..10" in capsys.readouterr().err


def test_sink_records_make_one_picture_reuse_exact(blv, loaded_models, monkeypatch):
    """With one picture the stored image sits after the same opening tokens at the same position: a
    record computed after them is the full-recompute K/V, so full reuse agrees exactly."""
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.link import linker
    from vlkv.runtime.link.spec import LinkSpec
    from vlkv.runtime.prompt import Prompt

    engine = Engine(loaded_models["tiny-llava"])
    pool = engine.new_cache(engine.encode([Prompt("x")])).pool
    item = blv.items_for(1, 1, seed=0)[0]
    monkeypatch.setattr(linker, "standalone_segment", blv.sink_segment)
    rows = blv.measure_item(engine, pool, item, [LinkSpec("none"), LinkSpec("full-reuse")], tokens=8)
    assert rows["full-reuse"]["reused"] > 0
    assert rows["full-reuse"]["agreement"] == 1.0 and abs(rows["full-reuse"]["kl"]) < 1e-4


def test_the_diagnosis_on_a_tiny_model(blv, loaded_models):
    """`--diagnose`: full recompute is its own reference (no divergence, zero deviation); a linked cache's
    deviation is reported per layer and picture, and full reuse's is not zero."""
    sys.path.insert(0, str(SCRIPT.parent))
    from link_diagnosis import diagnose_item, summarise

    from vlkv.runtime.engine import Engine
    from vlkv.runtime.link.spec import LinkSpec
    from vlkv.runtime.prompt import Prompt

    engine = Engine(loaded_models["tiny-llava"])
    pool = engine.new_cache(engine.encode([Prompt("x")])).pool
    item = blv.items_for(2, 1, seed=0)[0]
    specs = [LinkSpec("none"), LinkSpec("full-reuse"), LinkSpec("mpic", 4, pick="ramp")]
    row = diagnose_item(engine, pool, item, specs, tokens=5)
    none, reuse = row["methods"]["none"], row["methods"]["full-reuse"]
    assert none["agreement"] == 1.0 and none["first_divergence"] is None
    layers = engine.loaded.model.config.text_config.num_hidden_layers
    assert len(reuse["dk_linked"]) == layers and all(len(per) == 2 for per in reuse["dk_linked"])
    assert all(v == 0 for v in none["dk_question"])  # nothing linked: the same K everywhere
    assert max(max(x for x in per if x is not None) for per in reuse["dv_linked"]) > 0
    assert "deep_top_in_first" in reuse and len(reuse["deep_top_in_first"]) == 2
    assert set(summarise([row, row])) >= {"none", "full-reuse"}
