from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlkv.exporter.cli import EXIT_ERROR, EXIT_OK, EXIT_TRT_MISSING, main
from vlkv.exporter.manifest import read_manifest
from vlkv.exporter.recipe_loader import load_recipe

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "recipes" / "demo.yaml")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_demo_builds_every_stage_this_machine_can_run(tmp_path, capsys, monkeypatch):
    # No TensorRT / TensorRT-LLM here (and none forced elsewhere): both TRT stages report one line, exit 3.
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    out = tmp_path / "demo"
    code = main([DEMO, "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    status = {line.split()[0]: line.split()[1] for line in captured.out.splitlines()[1:]}
    assert status == {
        "vision_onnx": "ran",
        "decoder_onnx": "ran",
        "plugin_graph": "ran",
        "trt_engine": "unavailable",
        "trtllm_checkpoint": "ran",
        "trtllm_engine": "unavailable",
    }, captured
    assert code == EXIT_TRT_MISSING
    assert captured.err.splitlines() == [
        f"build-engine: TensorRT is not installed; skipped trt_engine (ONNX artifacts are in {out})",
        f"build-engine: TensorRT-LLM is not installed; skipped trtllm_engine (checkpoint is in "
        f"{(out / 'trtllm_checkpoint').resolve()}; command in {out / 'trtllm_engine' / 'build_command.sh'})",
    ]
    for stage in ("vision_onnx", "decoder_onnx", "plugin_graph", "trtllm_checkpoint"):
        manifest = read_manifest(out / stage)
        assert manifest is not None and manifest.stage == stage
    assert read_manifest(out / "vision_onnx").metrics["max_abs_err"] < 1e-4
    assert read_manifest(out / "trtllm_checkpoint").metrics["round_trip_max_abs_err"] == 0.0
    assert (out / "trtllm_engine" / "build_command.sh").read_text().split()[-2:] == [
        "--max_multimodal_len",
        "16",
    ]
    assert load_recipe(out / "resolved_recipe.yaml") == load_recipe(DEMO)

    # Second run: the verifiable stages are up to date.
    code = main(
        [DEMO, "--out", str(out), "--no-progress", "--stage", "vision_onnx", "--stage", "trtllm_checkpoint"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert code == EXIT_OK
    assert [line.split()[:2] for line in lines[1:]] == [
        ["vision_onnx", "skipped"],
        ["trtllm_checkpoint", "skipped"],
    ]


def test_trt_stage_missing_gives_exit_code_3(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    out = tmp_path / "b"
    code = main([DEMO, "--out", str(out), "--no-progress", "--set", "stages=[vision_onnx, trt_engine]"])
    assert code == EXIT_TRT_MISSING
    err = _one_line_error(capsys)
    assert err == f"build-engine: TensorRT is not installed; skipped trt_engine (ONNX artifacts are in {out})"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--set", "policy.budget=2"], "build-engine: error: policy.budget: must be in (0, 1], got 2.0"),
        (
            ["--set", "vision.opsett=17"],
            "build-engine: error: vision.opsett: unknown key (did you mean vision.opset?)",
        ),
        (
            ["--set", "model.name_or_path=ckpt/none"],
            "build-engine: error: model.name_or_path: checkpoint path 'ckpt/none'",
        ),
        (["--stage", "bogus"], "build-engine: error: argument --stage: invalid choice: 'bogus'"),
    ],
)
def test_errors_are_one_line_with_exit_2(argv, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) if argv[0] == "--stage" else _nothing():
        code = main([DEMO, "--out", str(tmp_path), "--no-progress", *argv])
        assert code == EXIT_ERROR
    assert _one_line_error(capsys).startswith(expected)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "policy.options.bogus=1",
            "policy.options.bogus: unknown option for policy 'elastic'; known: distance,",
        ),
        ("policy.options.budget=0.3", "policy.options.budget: set policy.budget instead"),
        ("policy.options.distance=abc", "policy.options.distance: expected int, got 'abc'"),
        ("policy.options.distance=null", "policy.options.distance: expected int, got None"),
        ("policy.options.distance=[1,2]", "policy.options.distance: expected int, got [1, 2]"),
        ("policy.options.start=1.5", "policy.options.start: expected int, got 1.5"),
        ("policy.options=5", "policy.options: expected a mapping, got 5"),
        (
            "policy.options.start=-5",
            "policy.options: policy 'elastic' rejects {'start': -5}: start must be >= 0",
        ),
        ("decoder.max_seq=[1,2", "--set decoder.max_seq: cannot parse value '[1,2'"),
        ("decoder.max_seq={a: [}", "--set decoder.max_seq: cannot parse value '{a: [}'"),
        ("decoder.max_seq=abc", "decoder.max_seq: expected an integer, got 'abc'"),
        ("decoder.max_seq=null", "decoder.max_seq: expected an integer, got None"),
        ("trt.fp16=maybe", "trt.fp16: expected true or false, got 'maybe'"),
        ("trt.ptx_arch=sm_75", "trt.ptx_arch: must be one of sm_80, sm_86,"),
        ("novalue", "--set 'novalue': expected KEY=VALUE"),
    ],
)
def test_bad_set_values_are_one_line_with_exit_2_and_nothing_written(override, expected, tmp_path, capsys):
    out = tmp_path / "b"
    assert main([DEMO, "--out", str(out), "--no-progress", "--set", override]) == EXIT_ERROR
    assert _one_line_error(capsys).startswith(f"build-engine: error: {expected}")
    assert not out.exists()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_missing_recipe_file(tmp_path, capsys):
    assert main([str(tmp_path / "nope.yaml"), "--no-progress"]) == EXIT_ERROR
    assert (
        _one_line_error(capsys)
        == f"build-engine: error: recipe file '{tmp_path / 'nope.yaml'}' does not exist"
    )


def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    missing = str(tmp_path / "missing.yaml")
    run = subprocess.run(
        [sys.executable, "-m", "vlkv.exporter", missing, "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert run.returncode == EXIT_ERROR
    assert run.stderr.strip() == f"build-engine: error: recipe file '{missing}' does not exist"
    helped = subprocess.run(
        [sys.executable, "-m", "vlkv.exporter", "--help"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert helped.returncode == EXIT_OK and "exit codes: 0 ok, 2 error, 3" in helped.stdout
