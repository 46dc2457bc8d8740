"""``vlkv generate``: a real run, JSON output, and one-line errors for bad input."""

from __future__ import annotations

import json

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
