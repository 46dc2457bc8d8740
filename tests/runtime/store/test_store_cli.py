"""``vlkv store {ls,stats,rm,gc}``: listings per tenant, removal by id, collection; user errors are one
line and exit 2 with the store untouched."""

from __future__ import annotations

import json
import os

import pytest

from tests.runtime.store.helpers import make_record
from vlkv.cli_common import OneLineParser as _Parser
from vlkv.runtime.store import SHARED_TENANT, ContextStore, DiskTier
from vlkv.store_cli import add_store_parser


def vlkv(*argv: str) -> int:
    """``vlkv store ...`` as ``vlkv.cli.main`` runs it (argparse usage errors exit 2 via SystemExit)."""
    parser = _Parser(prog="vlkv")
    add_store_parser(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code
    return args.func(args)


@pytest.fixture
def store_dir(tmp_path):
    store = ContextStore([DiskTier(tmp_path, 1 << 20)])
    recs = [make_record("alice"), make_record("alice", content=b"2"), make_record("bob")]
    for r in recs:
        store.put(r)
    store.put_shared(make_record(SHARED_TENANT, content=b"ref"))
    return tmp_path, recs


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_ls_lists_each_tenants_records(store_dir, capsys):
    path, (a1, a2, b) = store_dir
    assert vlkv("store", "ls", "--store", str(path), "--tenant", "alice", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["id"] for r in rows) == sorted([a1.key, a2.key])
    assert all(r["tenant"] == "alice" and r["bytes"] > 0 and r["age_s"] >= 0 for r in rows)
    assert vlkv("store", "ls", "--store", str(path)) == 0
    out = capsys.readouterr().out
    assert b.key in out and SHARED_TENANT in out and out.count("\n") == 5  # header + 4 records


def test_stats_counts_records_and_bytes_per_tenant(store_dir, capsys):
    path, (a1, a2, b) = store_dir
    (path / f"{'f' * 64}.vkr").write_bytes(b"junk")
    assert vlkv("store", "stats", "--store", str(path), "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["records"] == 5 and out["unreadable"] == 1
    assert out["tenants"]["alice"]["records"] == 2 and out["tenants"]["bob"]["records"] == 1
    assert out["bytes"] == sum(os.path.getsize(p) for p in path.iterdir())
    assert vlkv("store", "stats", "--store", str(path)) == 0
    assert "5 records" in capsys.readouterr().out


def test_rm_removes_by_id_only_within_the_tenant(store_dir, capsys):
    path, (a1, a2, b) = store_dir
    before = _files(path)
    assert vlkv("store", "rm", "--store", str(path), "--tenant", "alice", a1.key, b.key) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and b.key in err and "alice" in err
    assert _files(path) == before  # nothing removed when one id is refused
    assert vlkv("store", "rm", "--store", str(path), "--tenant", "alice", a1.key) == 0
    assert f"{a1.key}.vkr" not in _files(path) and len(_files(path)) == 3


def test_gc_removes_expired_and_corrupt_records(store_dir, capsys):
    path, (a1, a2, b) = store_dir
    store = ContextStore([DiskTier(path, 1 << 20)])
    store.put(make_record("bob", content=b"old", expires=1.0))
    raw = bytearray((path / f"{a2.key}.vkr").read_bytes())
    raw[-50] ^= 1
    (path / f"{a2.key}.vkr").write_bytes(bytes(raw))
    assert vlkv("store", "gc", "--store", str(path), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["expired"], report["corrupt"], report["evicted"]) == (1, 1, 0)
    assert sorted(_files(path)) == sorted(
        f"{k}.vkr" for k in (a1.key, b.key, make_record(SHARED_TENANT, content=b"ref").key)
    )
    assert vlkv("store", "gc", "--store", str(path), "--tenant", "bob", "--max-bytes", "0") == 0
    assert "1 over budget" in capsys.readouterr().out and f"{b.key}.vkr" not in _files(path)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["store", "ls", "--store", "{missing}"], "does not exist"),
        (["store", "ls", "--store", "{file}"], "not a directory"),
        (["store", "gc", "--store", "{file}/sub"], "not a directory"),
        (["store", "ls", "--store", "{dir}", "--tenant", "../bob"], "invalid tenant name '../bob'"),
        (["store", "rm", "--store", "{dir}", "../../etc/passwd"], "invalid record id"),
        (["store", "rm", "--store", "{dir}", "a" * 64], "no record"),
        (["store", "gc", "--store", "{dir}", "--max-bytes", "-1"], "--max-bytes"),
        (["store", "gc", "--store", "{dir}", "--max-bytes", "lots"], "invalid int"),
        (["store", "nope", "--store", "{dir}"], "invalid choice"),
        (["store"], "required"),
    ],
)
def test_user_errors_are_one_line_exit_2_and_touch_nothing(store_dir, capsys, argv, words):
    path, _ = store_dir
    afile = path.parent / "afile"
    afile.write_text("x")
    names = {"missing": path.parent / "missing", "file": afile, "dir": path}
    before = _files(path)
    assert vlkv(*[a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vlkv: error:") and words in err
    assert _files(path) == before and not names["missing"].exists()
