"""The continuous-batching stream on the ONNX Runtime backend: every request equals its solo run."""

from __future__ import annotations

from tests.runtime.test_ort_backend import onnx_cache, ort_engines  # noqa: F401 - shared fixtures
from tests.runtime.test_scheduler import _run_stream, _solo, _stream
from vlkv.runtime.request import Status


def test_a_stream_on_onnxruntime_equals_each_request_alone(ort_engines, images):  # noqa: F811
    engine = ort_engines["tiny-llava"]
    stream = _stream(images)
    reqs, sched = _run_stream(engine, stream)
    assert sched.max_concurrent > 8
    for r, (p, pol, kw, m) in zip(reqs, stream):
        assert r.status is Status.FINISHED, r.error
        assert r.tokens == _solo(engine, p, pol, kw, m), f"{r.id}: {pol} {kw}"
    assert sched.pool.used_bytes() == 0


def test_linking_on_onnxruntime_is_refused_in_one_line(ort_engines, images):  # noqa: F811
    import pytest

    from vlkv.runtime.link.spec import LinkSpec
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt

    engine = ort_engines["tiny-llava"]
    with pytest.raises(ValueError, match="linking needs the PyTorch backend; onnxruntime runs no link step"):
        engine.generate([Prompt("Hi", [images[0]])], make_policy("full"), 2, link=LinkSpec("mpic", 2))
