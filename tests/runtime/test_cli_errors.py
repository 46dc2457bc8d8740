"""``vlkv generate`` with bad input, as a careless or hostile user would type it.

Every case must end with exit status 2 and exactly one line on stderr naming the problem, before
the model computes anything (``Engine.generate`` is replaced by a failure here).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.runtime.cli_refusal import refused as _refused
from vlkv.cli import main
from vlkv.runtime.engine import Engine
from vlkv.runtime.limits import LimitError, check_fits, position_limit
from vlkv.runtime.prompt import Prompt, PromptError
from vlkv.runtime.sampling import Sampler


# ---------------------------------------------------------------- policy settings
@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("distance=abc", "distance must be an integer for policy 'elastic', got \"abc\""),
        ("distance=null", "distance must be an integer for policy 'elastic', got null"),
        ("distance=[1,2]", "distance must be an integer for policy 'elastic', got [1, 2]"),
        ("distance=2.5", "distance must be an integer"),
        ("distance=.nan", "distance must be an integer"),
        ("reference_quirks=maybe", "reference_quirks must be true or false"),
        ("positions=7", "positions must be a string"),
        ("start=10000", "start=10000 is past tiny-llava's position limit of 4096"),
        ("distance=-10000", "distance=-10000 is past tiny-llava's position limit of 4096"),
        ("distance=[1,", "--set distance: '[1,' is not a valid value (expected the node content"),
        ("distance={a: [}", "--set distance: '{a: [}' is not a valid value"),
        ("distance", "--set expects key=value, got 'distance'"),
        ("bogus=1", "unknown setting(s) bogus for policy 'elastic'"),
    ],
)
def test_bad_setting(capsys, no_model_compute, setting, needle):
    assert needle in _refused(capsys, "--set", setting)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--policy", "local", "--set", "sinks=1000"], "--set sinks=1000 keeps all "),
        (["--policy", "kvzip", "--set", "sinks=1000"], "--set sinks=1000 keeps all "),
        (["--policy", "elastic", "--set", "start=1000"], "--set start=1000 keeps all "),
        (
            ["--policy", "elastic", "--set", "start=20", "--set", "recent=40"],
            "--set start=20, --set recent=40",
        ),
        (
            ["--policy", "local", "--set", "sinks=1000", "--set", "evict_every=2"],
            "--set sinks=1000 keeps all ",
        ),
    ],
)
def test_settings_that_turn_compression_off_are_refused(capsys, no_model_compute, argv, needle):
    line = _refused(capsys, *argv)
    assert needle in line and "so budget 0.5 compresses nothing" in line


@pytest.mark.parametrize("value", ["2", "-1", "nan"])
def test_link_threshold_outside_zero_one(capsys, no_model_compute, value):
    assert "--link-threshold must be in [0, 1]" in _refused(capsys, "--link-threshold", value)


def test_setting_types_follow_the_policy_fields(capsys, no_model_compute):
    # avl's "core" is float | None: null is allowed there, a string is not.
    assert "core must be null or a finite number for policy 'avl', got \"x\"" in _refused(
        capsys, "--policy", "avl", "--budget", "0.5", "--set", "core=x"
    )
    assert "allocator_beta must be a finite number" in _refused(
        capsys, "--policy", "h2o", "--set", "allocator=pyramid", "--set", "allocator_beta=high"
    )


# ---------------------------------------------------------------- sampling
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0"])
def test_bad_temperature(capsys, no_model_compute, value):
    line = _refused(capsys, "--do-sample", f"--temperature={value}")
    assert "temperature must be a finite number > 0" in line


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--top-p", "nan"], "top_p must be in (0, 1]"),
        (["--top-k", "-1"], "top_k must be an integer >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value: 'many'"),
        (["--budget", "nan"], "budget must be in (0.0, 1.0]"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--seed", str(2**70)], "seed must be in [-2**63, 2**64)"),
        (["--cache-hit-rate", "--hit-rate-k", "nan"], "expected a count >= 1 or a fraction in (0, 1)"),
        (["--cache-hit-rate", "--hit-rate-k", "2.5"], "expected a count >= 1 or a fraction in (0, 1)"),
    ],
)
def test_bad_numbers(capsys, no_model_compute, argv, needle):
    assert needle in _refused(capsys, *argv)


def test_sampler_refuses_non_finite_temperature():
    for bad in (float("nan"), float("inf"), -0.5, 0.0):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            Sampler(do_sample=True, temperature=bad)


# ---------------------------------------------------------------- prompts and sizes
def test_prompt_not_utf8(capsys, no_model_compute):
    # Python hands undecodable argv bytes over as lone surrogates (surrogateescape).
    line = _refused(capsys, "--prompt", "ab\udcffc")
    assert line == "vlkv: error: prompt text is not valid UTF-8 (byte 0xff at character 2)"


def test_prompt_not_utf8_from_a_real_command_line():
    code = "import sys; from vlkv.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "generate", "--prompt", b"caf\xe9 au lait", "--max-new-tokens", "1"],
        capture_output=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == b""
    assert proc.stderr.splitlines() == [
        b"vlkv: error: prompt text is not valid UTF-8 (byte 0xe9 at character 3)"
    ]


def test_prompt_checks_its_own_fields():
    with pytest.raises(PromptError, match="not valid UTF-8"):
        Prompt("\udc80")
    with pytest.raises(PromptError, match="images must be a list, got NoneType None"):
        Prompt("hi", None)
    with pytest.raises(
        PromptError, match="image 2 must be a path, a builtin:NAME spec or a PIL image, got int 42"
    ):
        Prompt("hi", ["builtin:noise", 42])
    with pytest.raises(PromptError, match="raw must be true or false, got str 'no'"):
        Prompt("hi", [], "no")
    assert Prompt("hi", ("builtin:noise",)).images == ["builtin:noise"]


def test_huge_prompt_is_refused_before_the_model_runs(capsys, no_model_compute):
    # 20k words: byte-level tokens far past tiny-llava's 4096 positions (this once grew to 20 GB).
    line = _refused(capsys, "--prompt", " ".join(["word"] * 20_000))
    assert "the prompt is 100" in line and "tokens" in line
    assert "past tiny-llava's limit of 4096 (max_position_embeddings)" in line


def test_prompt_plus_new_tokens_past_the_limit(capsys, no_model_compute):
    line = _refused(capsys, "--prompt", "x" * 4000, "--max-new-tokens", "200")
    assert "with max_new_tokens 200 it needs" in line and "limit of 4096" in line


def test_batch_prompt_past_the_limit_is_named(capsys, no_model_compute, tmp_path):
    batch = tmp_path / "b.jsonl"
    rows = [{"prompt": "short"}, {"prompt": "y" * 5000}, {"prompt": "z" * 6000}]
    batch.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _refused(capsys, "--batch-file", str(batch))
    assert "prompt 2 of 3 is" in line and "(1 more prompt(s) too long)" in line


def test_check_fits():
    check_fits([10, 20], 30, 50, "m")
    check_fits([10_000], 10, None, "m")  # no stated limit: nothing to check
    with pytest.raises(
        LimitError, match="the prompt is 41 tokens; with max_new_tokens 10 it needs 51 positions"
    ):
        check_fits([41], 10, 50, "m")


def test_position_limit_reads_the_language_model(loaded_models):
    assert position_limit(loaded_models["tiny-llava"]) == 4096
    assert position_limit(loaded_models["tiny-qwen2-vl"].model.config) == 4096
    assert position_limit(object()) is None


# ---------------------------------------------------------------- models
def test_checkpoint_with_more_layers_than_weights(capsys, no_model_compute, loaded_models, tmp_path):
    loaded = loaded_models["tiny-llava"]
    loaded.model.save_pretrained(tmp_path)
    loaded.processor.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    layers = config["text_config"]["num_hidden_layers"]
    config["text_config"]["num_hidden_layers"] = layers + 2
    if "layer_types" in config["text_config"]:
        config["text_config"]["layer_types"] += config["text_config"]["layer_types"][:2]
    (tmp_path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # saving shows a progress bar
    line = _refused(capsys, "--model", str(tmp_path))
    assert f"checkpoint {tmp_path} lacks weights its config.json asks for" in line
    assert f"model.language_model.layers.{{{layers}, {layers + 1}}}.*" in line


# ---------------------------------------------------------------- batch files
@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (
            b'{"prompt": "a"}\n{"prompt": "b", "images": null}\n',
            "line 2: 'images' must be a list of image paths, got null",
        ),
        (b'{"prompt": "a", "images": [42]}\n', "line 1: 'images' must be a list of image paths, got [42]"),
        (b'{"prompt": "a", "images": "x.png"}\n', "line 1: 'images' must be a list of image paths"),
        (b'{"prompt": "a", "raw": "no"}\n', "line 1: 'raw' must be true or false, got \"no\""),
        (b'{"prompt": "a", "raw": 1}\n', "line 1: 'raw' must be true or false, got 1"),
        (b"", "is empty"),
        (b"\n  \n", "is empty"),
        (b"[]", "holds an empty list"),
        (b'{"prompt": "a"}\n\n{"prompt": "b",\n', "line 3 is not valid JSON"),
        (b'{"prompt": "a"}\nnot json\n', "line 2 is not valid JSON"),
        (b'[\n {"prompt": "a"},\n {"prompt": }\n]', "line 3 is not valid JSON"),
        (b'[{"prompt": "a"}, {"prompt": 3}]', "entry 2 needs a string 'prompt', got 3"),
        (b'{"prompt": "a"}\n["a"]\n', "line 2 must be an object"),
        (
            b'{"prompt": "a", "image": ["x.png"]}\n',
            "line 1: unknown key(s) image; known: prompt, images, raw",
        ),
        (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "line 2 is not valid UTF-8 (byte 0xe9)"),
        (b'{"prompt": "\\udcff"}\n', "line 1: prompt text is not valid UTF-8"),
        (b'{"prompt": "a", "images": ["no/such.png"]}\n', "line 1: image file not found: no/such.png"),
    ],
)
def test_bad_batch_file(capsys, no_model_compute, tmp_path, content, needle):
    path = tmp_path / "batch.jsonl"
    path.write_bytes(content)
    line = _refused(capsys, "--batch-file", str(path))
    assert f"batch file {path}" in line and needle in line


def test_missing_batch_file(capsys, no_model_compute, tmp_path):
    assert "batch file not found" in _refused(capsys, "--batch-file", str(tmp_path / "none.jsonl"))


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--device", "tpu"], "device must be one of cpu, cuda"),
        (["--pool-bytes", "0"], "--pool-bytes must be >= 1"),
        (["--pool-bytes", "1000"], "holds no token"),
        (["--pool-bytes", "50000"], "the pool holds"),
    ],
)
def test_device_and_pool_errors_are_one_line(argv, needle, capsys):
    from vlkv.cli import main

    code = main(["generate", "--model", "tiny-llava", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and needle in err, err


# ---------------------------------------------------------------- interrupts, paths, flag clashes
def test_batch_file_with_prompt_or_image_is_refused(capsys, no_model_compute, tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text('{"prompt": "a"}\n')
    line = _refused(capsys, "--batch-file", str(path), "--prompt", "hi", "--image", "builtin:noise")
    assert "--batch-file holds the prompts and images; --prompt and --image would be ignored" in line


def test_ctrl_c_in_generate_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    assert main(["generate", "--max-new-tokens", "2"]) == 130
    out, err = capsys.readouterr()
    assert err == "vlkv: interrupted\n"


def test_ctrl_c_in_build_engine_is_one_line_and_exit_130(capsys, monkeypatch):
    from vlkv.exporter import cli as exporter_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter_cli, "_build", interrupted)
    assert exporter_cli.main(["recipes/demo.yaml"]) == 130
    assert capsys.readouterr().err.strip() == "build-engine: interrupted"


@pytest.mark.parametrize("shape", ["file", "under-a-file"])
def test_file_shaped_onnx_cache_root_is_one_line(capsys, monkeypatch, tmp_path, shape):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    root = blocker if shape == "file" else blocker / "onnx"
    monkeypatch.setenv("VLKV_ONNX_CACHE", str(root))
    line = _refused(capsys, "--backend", "onnxruntime")
    assert f"ONNX export cache {root} is not a directory (a file is in the way): set VLKV_ONNX_CACHE" in line


def test_unwritable_onnx_cache_root(tmp_path, monkeypatch):
    from vlkv.runtime.onnx.export_cache import CacheRootError, usable_root

    monkeypatch.setattr("os.access", lambda path, mode: False)  # root ignores permission bits
    with pytest.raises(CacheRootError, match=f"ONNX export cache {tmp_path} is not writable"):
        usable_root(tmp_path)


def test_other_os_errors_are_one_line(capsys, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/some/where")

    monkeypatch.setattr(Engine, "generate", denied)
    assert main(["generate", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip() == "vlkv: error: Permission denied: /some/where"


def test_build_engine_refuses_a_checkpoint_missing_layers(loaded_models, tmp_path):
    import torch

    from vlkv.exporter.errors import StageError
    from vlkv.exporter.source import _load_checkpoint

    loaded = loaded_models["tiny-llava"]
    loaded.model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    layers = config["text_config"]["num_hidden_layers"]
    config["text_config"]["num_hidden_layers"] = layers + 2
    if "layer_types" in config["text_config"]:
        config["text_config"]["layer_types"] += config["text_config"]["layer_types"][:2]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        StageError, match=f"checkpoint {tmp_path} lacks weights its config.json asks for"
    ) as err:
        _load_checkpoint(tmp_path, "llava", torch.float32)
    assert f"model.language_model.layers.{{{layers}, {layers + 1}}}.*" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--smoke", "--out", "FILE"], "--out FILE is a file: it must be a folder"),
        (["--smoke", "--out", "FILE/sub"], "--out FILE/sub: cannot create the folder (Not a directory)"),
        (
            ["--smoke", "--model", "tiny-qwen2-vl"],
            "--smoke runs tiny-llava on 2 prompts; --model would be ignored",
        ),
        (["--smoke", "--model", "x", "--prompts", "3"], "--model and --prompts would be ignored: drop them"),
        (["--model", "tiny-llava", "--prompts", "0"], "--prompts must be >= 1, got 0"),
    ],
)
def test_evaluate_refuses_bad_out_and_smoke_clashes(capsys, monkeypatch, tmp_path, argv, needle):
    from vlkv.eval.run import main as evaluate

    def measured(*args, **kwargs):
        raise AssertionError("measured although the arguments should have been refused")

    monkeypatch.setattr("vlkv.eval.run.quality_records", measured)
    blocker = tmp_path / "report.md"
    blocker.write_text("x")
    argv = [a.replace("FILE", str(blocker)) for a in argv]
    assert evaluate(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle.replace("FILE", str(blocker)) in err, err


def test_a_real_sigint_during_generation_is_one_line_and_exit_130():
    """SIGINT delivered by the OS (not a raised KeyboardInterrupt) while the model runs."""
    import signal

    code = (
        # as from an interactive shell: a runner that started this suite in the background (bash
        # ignores SIGINT for `cmd &` without job control) passes the ignored SIGINT on to the child
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from vlkv.runtime.engine import Engine\n"
        "def slow(*a, **k):\n"
        "    print('running', flush=True)\n"
        "    time.sleep(60)\n"
        "Engine.generate = slow\n"
        "from vlkv.cli import main\n"
        "sys.exit(main(['generate', '--max-new-tokens', '2']))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "running"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130
    assert err.strip() == "vlkv: interrupted"
