"""Encoder pool: the processor call in a worker process gives what the in-thread call gives, and a
killed worker costs one request an error, never a hang."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image

from vlkv.runtime.encoder_pool import EncoderPool, EncoderUnavailable
from vlkv.runtime.prompt import Prompt


def _pictures(n: int, size: int = 96) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (size, size + 8 * i, 3), dtype=np.uint8)) for i in range(n)]


@pytest.fixture(scope="module")
def pools(engines):
    made = {name: EncoderPool(engines[name].loaded.processor) for name in ("tiny-llava", "tiny-qwen2-vl")}
    yield made
    for pool in made.values():
        pool.shutdown()


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_pool_encoding_equals_in_thread_encoding(engines, pools, name):
    engine, pool = engines[name], pools[name]
    prompts = [
        Prompt("Describe the pictures."),
        Prompt("word " * 50, _pictures(1)),
        Prompt("two", _pictures(2)),
    ]
    for prompt in prompts:
        ref, got = engine.encode([prompt]), engine.encode([prompt], process=pool.process)
        torch.testing.assert_close(got.input_ids, ref.input_ids, rtol=0, atol=0)
        torch.testing.assert_close(got.positions, ref.positions, rtol=0, atol=0)
        torch.testing.assert_close(got.modality, ref.modality, rtol=0, atol=0)
        assert got.spans == ref.spans
        a, b = ref.prompts[0].vision, got.prompts[0].vision
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)  # same bytes, same dtype


def test_pool_passes_a_processor_refusal_through(engines, pools):
    engine = engines["tiny-llava"]
    with pytest.raises(Exception) as ref:
        engine.encode([Prompt("<image> <image>", _pictures(1), raw=True)])
    with pytest.raises(type(ref.value)):
        engine.encode(
            [Prompt("<image> <image>", _pictures(1), raw=True)], process=pools["tiny-llava"].process
        )


# The two tests below break the module's tiny-llava pool on purpose (a pool recovers: that is what they
# check) instead of each starting a pool of its own: a spawned worker's start (torch and transformers
# imported) is ~5 s on a quiet 2-core machine, ~20 s on a loaded one.


def test_a_killed_worker_fails_one_call_and_the_pool_recovers(engines, pools):
    engine, pool = engines["tiny-llava"], pools["tiny-llava"]
    prompt = Prompt("after the crash", _pictures(1))
    ref = engine.encode([prompt])
    pool.warm()
    (pid,) = pool.pids()
    rebuilds = pool.rebuilds
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EncoderUnavailable, match="died"):
        engine.encode([prompt], process=pool.process)
    assert time.monotonic() - start < 30  # an error, not a hang
    assert pool.rebuilds == rebuilds + 1
    got = engine.encode([prompt], process=pool.process)  # the next call gets a new worker
    torch.testing.assert_close(got.input_ids, ref.input_ids, rtol=0, atol=0)
    assert pool.pids() and pool.pids() != [pid]


def test_a_hung_worker_times_out(engines, pools):
    engine, pool = engines["tiny-llava"], pools["tiny-llava"]
    pool.warm()
    (pid,) = pool.pids()
    timeout_s, pool.timeout_s = pool.timeout_s, 2
    os.kill(pid, signal.SIGSTOP)  # alive but never answers
    try:
        with pytest.raises(EncoderUnavailable, match="took over 2 s"):
            engine.encode([Prompt("hello")], process=pool.process)
        assert pool.pids() != [pid]  # the stopped worker was ended, a new one started
        # the new worker's first call includes its start-up (torch and transformers imported, seconds):
        # it gets the start's limit, not the 2 s one, so a slow start is not taken for a hang
        rebuilds = pool.rebuilds
        assert engine.encode([Prompt("hello")], process=pool.process).input_ids.numel() > 0
        assert pool.rebuilds == rebuilds
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        pool.timeout_s = timeout_s


def test_pool_settings_are_checked(engines):
    processor = engines["tiny-llava"].loaded.processor
    for kwargs, field in (
        ({"workers": 0}, "workers"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"context": "fork"}, "context"),
    ):
        with pytest.raises(ValueError, match=field):
            EncoderPool(processor, **kwargs)


def test_a_dead_encoder_is_a_503_in_the_server(engines):
    pytest.importorskip("fastapi", reason="vlkv serve needs the serve extra")
    from vlkv.serve.errors import ApiError
    from vlkv.serve.translate import encode

    class Dead:
        def process(self, **kwargs):
            raise EncoderUnavailable("the encoder process died; the pool was restarted, retry")

    with pytest.raises(ApiError) as err:
        encode(engines["tiny-llava"], Prompt("hello"), "prompt", Dead())
    assert err.value.status == 503 and "died" in str(err.value)
    with pytest.raises(ApiError) as err:  # a prompt the processor refuses stays a 400
        encode(engines["tiny-llava"], Prompt("<image>", [], raw=True), "prompt", Dead())
    assert err.value.status == 400
