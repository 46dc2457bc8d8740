"""A real ``vlkv serve`` (uvicorn on 127.0.0.1, a free port) per test module, started and stopped by PID.

Every wait is bounded: the server must answer ``/health`` within :data:`START_S`, and stops within
:data:`STOP_S` of SIGTERM or is killed.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="vlkv serve needs the serve extra: pip install 'vlkv[serve]'")
import httpx  # noqa: E402

MODEL = "tiny-llava"
START_S = 90.0
STOP_S = 30.0


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of ``/metrics`` (``vlkv_*`` names → value), labelled ones as ``name{labels}``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(vlkv_[A-Za-z0-9_]+(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_metric(self, name: str, want: float, timeout_s: float = 15.0) -> float:
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.metrics().get(name)
            if value == want:
                return value
            time.sleep(0.1)
        raise AssertionError(f"{name} stayed {value}, expected {want} within {timeout_s} s")

    def stop(self, timeout_s: float = STOP_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"server did not stop within {timeout_s} s of SIGTERM") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *args: str) -> Server:
    port = free_port()
    log = tmp / f"serve-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two shared cores: one thread each for server and tests
    cmd = [
        sys.executable,
        "-m",
        "vlkv.serve",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen([*cmd, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise AssertionError(f"server not healthy within {START_S} s: {log.read_text()[-2000:]}")


def png_bytes(seed: int = 0, size: int = 64) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "a.png").write_bytes(png_bytes(0))
    (d / "b.png").write_bytes(png_bytes(1))
    return d


@pytest.fixture(scope="module")
def engine():
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.registry import load_model

    return Engine(load_model(MODEL))
