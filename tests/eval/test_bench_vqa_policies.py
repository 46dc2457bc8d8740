"""scripts/bench_vqa_policies.py on the tiny LLaVA: the full cache scores KL 0 against itself, a
compressing policy a positive KL, every spec and budget gets a row, and bad specs fail before any work."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_vqa_policies.py"


@pytest.fixture(scope="module")
def bvp():
    spec = importlib.util.spec_from_file_location("bench_vqa_policies", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_rows_per_spec_and_budget(bvp, loaded_models):
    from vlkv.eval.vqa import build_set
    from vlkv.runtime.engine import Engine

    engine = Engine(loaded_models["tiny-llava"])
    items = [it for it in build_set(2, 0, 0, (), seed=0) if it.group == "single"]
    specs = ["full", "snapkv", "attnpack:evict=snapkv"]
    rows = bvp.run_group(engine, items, specs, [0.5, 0.25], new_tokens=4, batch=2)
    assert [(r["spec"], r["budget"]) for r in rows] == [
        ("full", None),
        ("snapkv", 0.5),
        ("snapkv", 0.25),
        ("attnpack:evict=snapkv", 0.5),
        ("attnpack:evict=snapkv", 0.25),
    ]
    full = rows[0]
    assert abs(full["kl"]) < 1e-5 and full["top1"] == 1.0 and full["n"] == 2
    assert rows[2]["kl"] > 1e-4  # a quarter of a random model's cache changes its distributions
    md = bvp.to_markdown(
        {
            "model": "tiny-llava",
            "machine": "m",
            "threads": 1,
            "seed": 0,
            "budgets": [0.5, 0.25],
            "specs": specs,
            "new_tokens": 4,
            "groups": {"single": rows},
        }
    )
    assert "| attnpack:evict=snapkv |" in md and "## single (n = 2)" in md


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--specs", "nosuch"], "nosuch"),
        (["--specs", "snapkv:window=x=1"], "snapkv"),
        (["--budgets", "1.5"], "--budgets"),
    ],
)
def test_bad_arguments_are_one_line(bvp, argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        bvp.main([*argv, "--out", str(tmp_path / "x")])
    assert err.value.code == 2
    assert message in capsys.readouterr().err
