"""The build lock beside a model cache (``vlkv/runtime/models/build_lock.py``): it records its holder, is
released when the build raises, and a waiter names the holder (the waiting itself is tested through
smollm2-llava's builders, tests/runtime/models/test_smollm2_llava.py)."""

from __future__ import annotations

import fcntl
import logging
import os
import threading

import pytest

from vlkv.runtime.models.build_lock import build_lock


def test_the_holder_is_recorded_and_a_raising_build_releases_the_lock(tmp_path, caplog):
    target = tmp_path / "sub" / "model"
    with pytest.raises(RuntimeError, match="build failed"), build_lock(target, "m"):
        assert (tmp_path / "sub" / "model.lock").read_text() == str(os.getpid())
        raise RuntimeError("build failed")
    with caplog.at_level(logging.WARNING), build_lock(target, "m"):
        pass  # free again: no wait, no warning
    assert not caplog.records


def test_a_waiter_names_the_holder(tmp_path, caplog):
    target = tmp_path / "model"
    with open(tmp_path / "model.lock", "w") as held:  # another "process" holds it, then lets go
        held.write("12345")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        release = threading.Timer(0.3, fcntl.flock, (held, fcntl.LOCK_UN))
        release.start()
        with caplog.at_level(logging.WARNING), build_lock(target, "tiny"):
            pass
        release.join()
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("tiny: waiting for process 12345") and str(target) in message
