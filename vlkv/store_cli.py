"""``vlkv store {ls,stats,rm,gc} --store DIR [--tenant NAME]``: inspect and maintain a context store.

Wired into ``vlkv`` by :func:`add_store_parser`. These commands never create a store: a missing
directory, a path that is a file, an unwritable directory, a bad tenant name or record id is one
line on stderr and exit status 2, with nothing in the store touched.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

EXIT_USAGE = 2


def add_store_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``store`` and its subcommands to ``subparsers`` (the ``vlkv`` command's)."""
    store = subparsers.add_parser("store", help="list, count, remove and collect context-store records")
    sub = store.add_subparsers(dest="store_command", required=True, metavar="{ls,stats,rm,gc}")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--store", required=True, metavar="DIR", help="the store directory")
        p.add_argument("--tenant", default=None, metavar="NAME", help="only this tenant's records")
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.set_defaults(func=cmd_store, store_func=_HANDLERS[name])
        return p

    command("ls", "list records: id, tenant, size, age, expiry")
    command("stats", "count records and bytes per tenant")
    rm = command("rm", "remove records by id")
    rm.add_argument("ids", nargs="+", metavar="ID", help="record id (64 hex digits, as `ls` prints)")
    gc = command("gc", "remove expired, corrupt, stale and over-budget records and old temp files")
    gc.add_argument(
        "--max-bytes", type=int, default=None, help="keep at most this many bytes (LRU goes first)"
    )
    gc.add_argument(
        "--temp-age", type=float, default=600.0, help="remove temp files older than this many seconds"
    )
    return store


def cmd_store(args: argparse.Namespace) -> int:
    """Run a ``vlkv store`` subcommand; a user error is one line on stderr and exit status 2."""
    from vlkv.runtime.store import ContextStore, DiskTier, validate_tenant

    try:
        if args.tenant is not None:
            validate_tenant(args.tenant, allow_reserved=True)
        if getattr(args, "max_bytes", None) is not None and args.max_bytes < 0:
            raise ValueError(f"--max-bytes must be >= 0, got {args.max_bytes}")
        writes = args.store_func in (_rm, _gc)
        disk = DiskTier(args.store, max_bytes=1 << 62, create=False, writable=writes)
        return args.store_func(ContextStore([disk]), disk, args)
    except (ValueError, OSError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"vlkv: error: {msg}", file=sys.stderr)
        return EXIT_USAGE


def _rows(store, tenant: str | None) -> list[dict]:
    now = time.time()
    rows = []
    for e in store.entries():
        if tenant is not None and (e.info is None or e.info.tenant != tenant):
            continue
        row = {"id": e.key, "bytes": e.nbytes, "tenant": None, "age_s": None, "expires_in_s": None}
        if e.info is None:
            row["problem"] = e.problem
        else:
            row["tenant"], row["age_s"] = e.info.tenant, round(now - e.info.created, 1)
            if e.info.expires is not None:
                row["expires_in_s"] = round(e.info.expires - now, 1)
        rows.append(row)
    return rows


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = abs(seconds)
    text = (
        f"{s:.0f}s"
        if s < 120
        else f"{s / 60:.0f}m"
        if s < 7200
        else f"{s / 3600:.0f}h"
        if s < 172800
        else f"{s / 86400:.0f}d"
    )
    return f"-{text}" if seconds < 0 else text


def _ls(store, disk, args) -> int:
    rows = _rows(store, args.tenant)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'ID':64}  {'TENANT':16}  {'BYTES':>10}  {'AGE':>6}  EXPIRES")
    for r in rows:
        if "problem" in r:
            print(f"{r['id']}  {'?':16}  {r['bytes']:>10}  {'-':>6}  {r['problem']}")
            continue
        expires = "never" if r["expires_in_s"] is None else f"in {_age(r['expires_in_s'])}"
        print(f"{r['id']}  {r['tenant']:16}  {r['bytes']:>10}  {_age(r['age_s']):>6}  {expires}")
    return 0


def _stats(store, disk, args) -> int:
    rows = _rows(store, args.tenant)
    tenants: dict[str, dict[str, int]] = {}
    for r in rows:
        t = tenants.setdefault(r["tenant"] or "?", {"records": 0, "bytes": 0})
        t["records"] += 1
        t["bytes"] += r["bytes"]
    expired = sum(1 for r in rows if r["expires_in_s"] is not None and r["expires_in_s"] <= 0)
    out = {
        "store": str(disk.path),
        "records": len(rows),
        "bytes": sum(r["bytes"] for r in rows),
        "unreadable": sum(1 for r in rows if "problem" in r),
        "expired": expired,
        "temp_files": len(disk.temp_files()),
        "tenants": tenants,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"store {out['store']}: {out['records']} records, {out['bytes']} bytes")
    print(f"  unreadable headers {out['unreadable']}, expired {expired}, temp files {out['temp_files']}")
    for name, t in sorted(tenants.items()):
        print(f"  {name:16} {t['records']:>6} records {t['bytes']:>12} bytes")
    return 0


def _rm(store, disk, args) -> int:
    from vlkv.runtime.store import validate_key
    from vlkv.runtime.store.record import peek

    for key in args.ids:  # every id is checked before anything is removed
        validate_key(key)
        got = disk.head(key)
        if got is None:
            raise ValueError(f"no record {key} in store {disk.path}")
        if args.tenant is not None:
            try:
                owner = peek(*got).tenant
            except ValueError:
                owner = None
            if owner != args.tenant:
                raise ValueError(f"record {key} does not belong to tenant {args.tenant!r}")
    removed = sum(store.delete(key) for key in dict.fromkeys(args.ids))
    print(json.dumps({"removed": removed}) if args.json else f"removed {removed} record(s)")
    return 0


def _gc(store, disk, args) -> int:
    report = store.gc(max_bytes=args.max_bytes, temp_age_s=args.temp_age, tenant=args.tenant)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"removed: {report['expired']} expired, {report['corrupt']} corrupt, {report['stale']} stale, "
        f"{report['evicted']} over budget, {report['temp']} temp files; freed {report['freed_bytes']} bytes"
    )
    return 0


_HANDLERS = {"ls": _ls, "stats": _stats, "rm": _rm, "gc": _gc}
