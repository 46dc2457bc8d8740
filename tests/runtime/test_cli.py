"""``vlkv generate``: a real run, what its output says, JSON output, and one-line errors for bad input.

More bad input (settings, sampling values, prompts, images, batch files, sizes) is in test_cli_errors.py.
"""

from __future__ import annotations

import json
import re

import pytest

from vlkv.cli import main


def _run(capsys, *argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_reports_cache_and_times(capsys, loaded_models):
    code, out, err = _run(
        capsys,
        "--model",
        "tiny-llava",
        "--policy",
        "h2o",
        "--budget",
        "0.5",
        "--max-new-tokens",
        "4",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    sample = report["samples"][0]
    assert len(sample["token_ids"]) == 4
    assert (
        len(sample["kept_per_layer"])
        == loaded_models["tiny-llava"].model.config.text_config.num_hidden_layers
    )
    assert 0 < report["kv_bytes_used"] < report["full_kv_bytes"]
    assert report["prefill_s"] > 0 and report["decode_s"] > 0
    assert report["model"] == "tiny-llava"
    assert report["prompts"] == [{"text": "Describe the image.", "images": ["builtin:checkerboard"]}]


def test_default_run_says_what_it_ran_and_what_compression_saved(capsys):
    code, out, err = _run(capsys, "--max-new-tokens", "3")
    assert code == 0, err
    assert out.strip(), "the answer goes to stdout"
    assert "-- model: tiny-llava (built-in tiny model with random weights" in err
    assert "-- policy: elastic, budget 0.5" in err
    assert '-- prompt: "Describe the image." + builtin:checkerboard (' in err
    kv = re.search(r"-- kv: ([\d.]+) KiB of ([\d.]+) KiB full \((\d+)% saved\)", err)
    assert kv, err
    used, full, saved = float(kv[1]), float(kv[2]), int(kv[3])
    assert 0 < used < full and saved == round(100 * (1 - used / full))


def test_policy_full_runs_without_a_budget(capsys):
    code, out, err = _run(capsys, "--policy", "full", "--prompt", "hello there", "--max-new-tokens", "2")
    assert code == 0, err
    assert "-- policy: full, no budget" in err
    assert "(0% saved)" in err
    code, out, err = _run(capsys, "--policy", "full", "--max-new-tokens", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["budget"] == 1.0 and report["kv_bytes_used"] == report["full_kv_bytes"]


def test_attnpack_runs_with_its_defaults(capsys):
    """attnpack compresses by rank: the CLI's default budget (0.5) must not reach it, whose budget
    without evict=NAME can only be 1; with evict=NAME the default budget applies to the eviction."""
    code, out, err = _run(capsys, "--policy", "attnpack", "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["budget"] == 1.0
    code, out, err = _run(
        capsys, "--policy", "attnpack", "--set", "evict=h2o", "--max-new-tokens", "2", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["budget"] == 0.5


def test_default_budget_in_help_is_the_runtime_one(capsys):
    from vlkv.cli import build_parser
    from vlkv.runtime.policies.settings import DEFAULT_BUDGET

    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert f"(default: {DEFAULT_BUDGET};" in " ".join(help_text.split())


def test_policy_full_with_a_budget_below_one_is_one_line(capsys):
    code, out, err = _run(capsys, "--policy", "full", "--budget", "0.5", "--max-new-tokens", "2")
    assert code == 2 and out == ""
    assert err.strip() == "vlkv: error: budget must be 1.0 for policy 'full', got 0.5"


def test_batch_output_numbers_each_prompt(capsys, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"prompt": "one", "images": ["builtin:noise"]}\n{"prompt": "two"}\n')
    code, out, err = _run(capsys, "--batch-file", str(batch), "--max-new-tokens", "2")
    assert code == 0, err
    assert [line[:4] for line in out.splitlines() if line.startswith("[")] == ["[0] ", "[1] "]
    assert '-- [0] prompt: "one" + builtin:noise (' in err
    assert '-- [1] prompt: "two" + no image (' in err


def test_empty_answer_is_explained_not_an_empty_line():
    from vlkv.cli import _answer
    from vlkv.runtime.engine import SampleResult

    def sample(text, ids):
        return SampleResult(text=text, token_ids=ids, prompt_tokens=5, kept_per_layer=[5])

    # smollm2-llava's first token after the default prompt can be its end-of-turn token.
    assert _answer(sample("", [2]), eos={2}) == (
        "(empty answer: the model ended its answer at once; token ids [2])"
    )
    assert _answer(sample("  ", [7, 2]), eos={2}) == (
        "(empty answer: 2 token(s) that decode to no visible text; token ids [7, 2])"
    )
    assert _answer(sample("a\x1bb", [1, 2, 3]), eos={2}) == "a\u00b7b"


def test_batch_file_with_different_image_counts(capsys, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        '{"prompt": "one", "images": ["builtin:checkerboard"]}\n'
        '{"prompt": "two images", "images": ["builtin:gradient", "builtin:noise"]}\n'
        '{"prompt": "no image"}\n'
    )
    code, out, err = _run(
        capsys,
        "--model",
        "tiny-qwen2-vl",
        "--policy",
        "snapkv",
        "--budget",
        "0.3",
        "--batch-file",
        str(batch),
        "--max-new-tokens",
        "3",
        "--json",
    )
    assert code == 0, err
    assert len(json.loads(out)["samples"]) == 3


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--budget", "0"], "budget must be in (0.0, 1.0]"),
        (["--budget", "1.5"], "budget must be in (0.0, 1.0]"),
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--policy", "h2o", "--set", "bogus=1"], "unknown setting(s) bogus"),
        (
            ["--prompt", "USER: <image> <image> hi ASSISTANT:", "--raw", "--image", "builtin:noise"],
            "2 image placeholder(s)",
        ),
        (["--prompt", "hi", "--image", "no/such/file.png"], "no/such/file.png"),
        (["--model", "no-such-model"], "no-such-model"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, needle):
    code, out, err = _run(capsys, "--max-new-tokens", "2", *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0]


def test_cache_hit_rate_in_json(capsys):
    code, out, err = _run(
        capsys,
        "--policy",
        "vlcache",
        "--budget",
        "0.3",
        "--cache-hit-rate",
        "--hit-rate-k",
        "4",
        "--max-new-tokens",
        "2",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)["extras"]["cache_hit_rate"]
    assert len(report["per_layer"]) == 4 and all(0 <= r <= 1 for r in report["per_layer"])


def test_link_k_not_below_the_image_tokens_is_named(capsys, tmp_path):
    """The README's old example: --link-k 32 on tiny-llava, whose images are 16 tokens, hits and
    reuses nothing; the CLI says so, and a k below 16 reuses the rest of each image."""
    batch = tmp_path / "p.jsonl"
    batch.write_text(
        '{"prompt": "What is it?", "images": ["builtin:noise"]}\n'
        '{"prompt": "And the colours?", "images": ["builtin:noise"]}\n'
    )
    # --link-threshold 0: the operator's opt-in to linking a model with no saved link-check
    common = ["--batch-file", str(batch), "--policy", "full", "--link", "mpic", "--max-new-tokens", "2"]
    common += ["--link-threshold", "0"]
    code, _, err = _run(capsys, *common, "--link-k", "32", "--store", str(tmp_path / "a"))
    assert code == 0, err
    assert "-- note: --link-k 32 is not below an image's 16 tokens" in err
    assert "0 tokens reused" in err
    code, _, err = _run(capsys, *common, "--link-k", "4", "--store", str(tmp_path / "b"))
    assert code == 0, err
    assert "-- note" not in err and "12 tokens reused" in err
