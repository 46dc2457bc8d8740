"""``--store`` values → a :class:`~vlkv.runtime.store.store.ContextStore`.

Accepted forms::

    /var/cache/vlkv                      a directory: [device,] host, disk tiers (ContextStore.open)
    redis://127.0.0.1:6379/0             [device,] host, [disk,] redis tiers
    rediss://user:pw@host:6380/0         the same over TLS
    mooncake://127.0.0.1:50051           [device,] host, [disk,] mooncake tiers

Query parameters of a remote URL (all optional):

    timeout=2          seconds a remote call may take before it is a ``timeout`` fault (a miss); size it
                       for the largest record (a dense fp32 576-token record is 27 MiB)
    disk=/path         also keep a local disk tier between host memory and the remote tier
    prefix=vlkv        Redis key namespace (keys are ``<prefix>:rec:<record key>``)
    metadata=URL       Mooncake metadata server (default ``http://<master host>:8080/metadata``)
    protocol=tcp       Mooncake transfer protocol (tcp; rdma where the NICs exist)
    segment=256MiB     memory this process contributes to the Mooncake pool
    buffer=64MiB       this process's Mooncake transfer buffer
    local=127.0.0.1    the address other Mooncake clients reach this process at
    admin=URL          the Mooncake master's HTTP admin server (default ``http://<master host>:9003``)

The remote tier is the last one, so every put is written through to it and every process on the
same URL sees every other process's records; the host tier in front keeps this process's hot ones.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import torch

from vlkv.runtime.store.store import DEFAULT_DISK_BYTES, DEFAULT_HOST_BYTES, ContextStore
from vlkv.runtime.store.tiers import DeviceTier, DiskTier, HostTier, Tier

REMOTE_SCHEMES = ("redis", "rediss", "mooncake")
_OURS = {"timeout", "disk", "prefix", "metadata", "protocol", "segment", "buffer", "local", "admin"}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20}
_UNITS |= {"mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def is_remote(spec: str) -> bool:
    return urlsplit(str(spec)).scheme in REMOTE_SCHEMES


def open_store(
    spec: str | os.PathLike,
    *,
    host_bytes: int = DEFAULT_HOST_BYTES,
    disk_bytes: int = DEFAULT_DISK_BYTES,
    device_bytes: int = 0,
    device: torch.device | str | None = None,
    create: bool = True,
    **store_kwargs,
) -> ContextStore:
    """The context store ``spec`` names (see the module docstring); ``store_kwargs`` go to
    :class:`ContextStore` (``model_fingerprint``, ``static_ttl_s``, ``clock``).

    A bad URL or an unknown query parameter is a one-line ``ValueError`` naming it. A remote server
    that is down is not an error: the store starts, its remote tier misses and counts faults.
    """
    text = os.fspath(spec)
    parts = urlsplit(text)
    if parts.scheme in ("", "file") or (len(parts.scheme) == 1 and os.name == "nt"):
        path = parts.path if parts.scheme == "file" else text
        return ContextStore.open(
            path,
            disk_bytes=disk_bytes,
            host_bytes=host_bytes,
            device_bytes=device_bytes,
            device=device,
            create=create,
            **store_kwargs,
        )
    if parts.scheme not in REMOTE_SCHEMES:
        raise ValueError(
            f"--store {text!r}: scheme {parts.scheme!r} is not one of file, {', '.join(REMOTE_SCHEMES)}"
        )
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    remote = _remote_tier(parts, query, text)
    tiers: list[Tier] = []
    if device_bytes:
        tiers.append(DeviceTier(device_bytes, device or "cuda"))
    if host_bytes:
        tiers.append(HostTier(host_bytes))
    if query.get("disk"):
        tiers.append(DiskTier(query["disk"], disk_bytes, create=create))
    tiers.append(remote)
    return ContextStore(tiers, **store_kwargs)


def _remote_tier(parts, query: dict[str, str], text: str) -> Tier:
    timeout_s = _float(query, "timeout", 2.0, text)
    if parts.scheme in ("redis", "rediss"):
        from vlkv.runtime.store.redis_tier import RedisTier

        unknown = sorted(k for k in query if k not in _OURS and not _redis_option(k))
        if unknown:
            raise ValueError(f"--store {text!r}: unknown parameter(s) {unknown}; known: {sorted(_OURS)}")
        rest = urlencode([(k, v) for k, v in query.items() if k not in _OURS])
        url = urlunsplit((parts.scheme, parts.netloc, parts.path or "/0", rest, ""))
        return RedisTier(url, timeout_s=timeout_s, prefix=query.get("prefix", "vlkv"))
    from vlkv.runtime.store.mooncake_tier import MooncakeTier

    unknown = sorted(k for k in query if k not in _OURS)
    if unknown:
        raise ValueError(f"--store {text!r}: unknown parameter(s) {unknown}; known: {sorted(_OURS)}")
    if not parts.hostname or not parts.port:
        raise ValueError(f"--store {text!r}: a mooncake URL needs the master's host:port")
    return MooncakeTier(
        master=f"{parts.hostname}:{parts.port}",
        metadata=query.get("metadata", f"http://{parts.hostname}:8080/metadata"),
        protocol=query.get("protocol", "tcp"),
        segment_bytes=_size(query, "segment", 256 << 20, text),
        buffer_bytes=_size(query, "buffer", 64 << 20, text),
        local_hostname=query.get("local", "127.0.0.1"),
        timeout_s=timeout_s,
        prefix=query.get("prefix", "vlkv"),
        admin=query.get("admin"),
    )


def _redis_option(name: str) -> bool:
    """Query options redis-py's ``from_url`` understands itself (passed through)."""
    return name in {"db", "health_check_interval", "client_name", "ssl_cert_reqs", "ssl_ca_certs", "protocol"}


def _float(query: dict[str, str], name: str, default: float, text: str) -> float:
    if name not in query:
        return default
    try:
        value = float(query[name])
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"--store {text!r}: {name} must be a number > 0, got {query[name]!r}")
    return value


def _size(query: dict[str, str], name: str, default: int, text: str) -> int:
    if name not in query:
        return default
    raw = query[name].strip().lower()
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    try:
        value = int(float(digits) * _UNITS[unit])
    except (ValueError, KeyError):
        value = 0
    if value <= 0:
        raise ValueError(f"--store {text!r}: {name} must be a size like 256MiB, got {query[name]!r}")
    return value
