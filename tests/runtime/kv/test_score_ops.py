"""The seam between policies and the score-table kernels (``kv.score_ops``): policies hold no backend
switch, and each operation's C++ form (``vlkv/plugins/evict_rows.py``) and torch form give the same
floats and columns bit for bit (``torch.equal``) on odd sizes, strided tables and strided colsums;
tables the kernel does not take (another dtype, another device, shared memory, the switch off) run
the torch form."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlkv
import vlkv.plugins.evict_rows as evict_rows
from vlkv.runtime.kv import score_ops

POLICIES = Path(vlkv.__file__).parent / "runtime" / "policies"
# what deciding a backend looks like: the kernels' module or switches, device tests
SWITCHES = re.compile(
    r"evict_rows|FUSED_|VLKV_CPU|\.kernel\(\)|\.is_cpu|\.is_cuda|device\.type|MAX_GROUP_SUM"
)


def test_policies_hold_no_backend_switch():
    """No policy module imports a kernel module (``vlkv.plugins``, lazily or not), names a kernel or
    its switch, or tests where a tensor lies: policies call ``kv.score_ops`` (and the cache)
    unconditionally."""
    files = sorted(POLICIES.glob("*.py"))
    assert len(files) > 10
    imports = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            imports += [f"{path.name}: {n}" for n in names if n.startswith("vlkv.plugins")]
    assert not imports, imports
    found = [
        f"{path.name}:{i}: {line.strip()}"
        for path in files
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if SWITCHES.search(line)
    ]
    assert not found, "policies decide, backends execute:\n" + "\n".join(found)


def test_avl_counts_the_region_code_the_step_counts():
    from vlkv.runtime.policies import avl

    assert avl.TEXT == score_ops.TEXT


class _Spy:
    """The extension with every entry point that does work counted (``tables_apart`` only asks)."""

    def __init__(self, mod):
        self.mod, self.calls = mod, []

    def __getattr__(self, name):
        fn = getattr(self.mod, name)
        if name == "tables_apart":
            return fn

        def call(*args):
            self.calls.append(name)
            return fn(*args)

        return call


def _built():
    """The evict-rows kernel; a C++ compiler is part of the CPU test environment (``.ci/run``)."""
    mod = evict_rows.kernel()
    if mod is None:
        pytest.fail("the evict-rows kernel did not build (is a C++ compiler installed?)")
    return mod


def _run(monkeypatch, kernel: bool, fn, *args):
    """``fn(*args)`` with the kernel on (it must be called) or off; returns the result."""
    mod = _built() if kernel else evict_rows.kernel()
    spy = _Spy(mod)
    with monkeypatch.context() as m:
        m.setattr(evict_rows, "FUSED_DROP", kernel)
        m.setattr(evict_rows, "kernel", lambda: spy)
        out = fn(*args)
    assert bool(spy.calls) == kernel, spy.calls
    return out


def _sums(b: int, h: int, group: int, s: int, layers: int, seed: int) -> list[torch.Tensor]:
    """Softmax-like colsums ``(B, H_kv · G, s)``: strided views of a ``(B, H_kv, G, s + 3)`` layout,
    a few large values, many tiny, exact zeros."""
    g = torch.Generator().manual_seed(seed)
    probs = [torch.rand(b, h, group, s + 3, generator=g) ** 8 for _ in range(layers)]
    for p in probs:
        p[..., ::5] = 0.0
        p /= p.sum(-1, keepdim=True).clamp_min(1e-30)
    return [p[..., :s].flatten(1, 2) for p in probs]


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("s", [1, 9, 81, 729])
def test_add_group_sums_kernel_equals_torch(group, s, monkeypatch):
    """Strided score tables (rows of a wider table), strided colsums, a narrower colsum than the
    table: the same floats by the kernel and by torch."""
    b, h, layers = 3, 5, 4
    g = torch.Generator().manual_seed(s + group)
    wide = [torch.rand(b, h, s + 9, generator=g) * 3 for _ in range(layers)]
    colsums = _sums(b, h, group, s, layers, s)
    got = [t.clone()[:, :, : s + 4] for t in wide]
    want = [t.clone()[:, :, : s + 4] for t in wide]
    assert got[0].stride(1) == s + 9  # strided rows
    _run(monkeypatch, True, score_ops.add_group_sums, got, colsums, h)
    _run(monkeypatch, False, score_ops.add_group_sums, want, colsums, h)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)


def test_add_group_sums_takes_torch_where_the_kernel_does_not(monkeypatch):
    """A group above ``MAX_GROUP_SUM`` (torch's ``sum`` adds it in another order), float16 tables
    and a table listed twice (one C++ region would race): the torch form, which adds a twice-listed
    table twice."""
    _built()
    b, h, s = 2, 3, 17
    monkeypatch.setattr(evict_rows, "FUSED_DROP", True)
    spy = _Spy(evict_rows.kernel())
    monkeypatch.setattr(evict_rows, "kernel", lambda: spy)
    big = evict_rows.MAX_GROUP_SUM + 1
    sums = _sums(b, h, big, s, 1, 1)
    got = torch.rand(b, h, s)
    want = got.clone().add_(sums[0].view(b, h, big, s).sum(2))
    score_ops.add_group_sums([got], sums, h)
    assert torch.equal(got, want)
    half = torch.zeros(b, h, s, dtype=torch.float16)
    score_ops.add_group_sums([half], [c.half() for c in _sums(b, h, 2, s, 1, 2)], h)
    one = torch.zeros(b, h, s)
    sums = _sums(b, h, 2, s, 2, 3)
    score_ops.add_group_sums([one, one], sums, h)
    want = torch.zeros(b, h, s)
    for c in sums:
        want.add_(c.view(b, h, 2, s).sum(2))
    assert torch.equal(one, want)
    assert spy.calls == []
    score_ops.add_group_sums([torch.zeros(b, h, s), torch.zeros(b, h, s)], sums, h)
    assert spy.calls == ["add_group_sums"]  # the same call on tables apart takes the kernel


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("width", [0, 1, 9, 81, 729])
def test_text_step_kernel_equals_torch(group, width, monkeypatch):
    """Regions mixed per head, ragged lengths, ``-0.0`` scores (turned ``+0.0`` by both), strided
    colsums wider than the held columns: the same text scores (by their bits) and counts."""
    g = torch.Generator().manual_seed(group * 1000 + width)
    b, h, layers, cap = 3, 5, 3, width + 6
    regions = [torch.randint(0, 3, (b, h, cap), generator=g).float() for _ in range(layers)]
    scores = [torch.rand(b, h, cap, generator=g) for _ in range(layers)]
    for t in scores:
        t[:, :, ::4] = -0.0
    colsums = _sums(b, h, group, width + 2, layers, width)
    lengths = [torch.randint(0, width + 1, (b,), generator=g) for _ in range(layers)]
    widths = [width, max(width - 1, 0), width]
    got, want = [t.clone() for t in scores], [t.clone() for t in scores]
    held = _run(monkeypatch, True, score_ops.text_step, regions, got, colsums, widths, lengths, h)
    ref = _run(monkeypatch, False, score_ops.text_step, regions, want, colsums, widths, lengths, h)
    assert held.dtype == ref.dtype == torch.long
    assert torch.equal(held, ref)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))  # bits: -0.0 is not +0.0


@pytest.mark.parametrize("s", [1, 4, 9, 81, 729])
@pytest.mark.parametrize("per_head", [False, True])
def test_lowest_columns_kernel_equals_torch(s, per_head, monkeypatch):
    """Strided score views, ties (-0.0 beside 0.0), NaN, ±inf, invalid and forced columns (per
    sample or per head): the same column per row by the kernel and by the stacked torch ranking."""
    g = torch.Generator().manual_seed(s)
    b, h, layers = 3, 4, 5
    tables = [torch.randint(0, 6, (b, h, s + 7), generator=g).float() / 4 for _ in range(layers)]
    for t in tables:
        t[0, 0, : s // 2] = 0.0
        t[0, 0, 1::3] = -0.0
        t[1, 1, s // 2] = float("nan")
        t[1, 2, 0] = float("-inf")
        t[2, 3, s - 1] = float("inf")
    views = [t[:, :, :s] for t in tables]
    lengths = torch.tensor([s, s - 1, s - 3]).clamp(min=1)
    valid = (torch.arange(s)[None, :] < lengths[:, None])[:, None]
    forced = torch.rand(b, h if per_head else 1, s, generator=g) < 0.2
    for force in (None, forced):
        got = _run(monkeypatch, True, score_ops.lowest_columns, views, valid, force)
        want = _run(monkeypatch, False, score_ops.lowest_columns, views, valid, force)
        assert got.shape == (layers * b, h, 1)
        assert torch.equal(got, want)


def test_lowest_columns_of_other_dtypes_and_devices_rank_in_torch(monkeypatch):
    """bfloat16 scores and tables on another device (``meta``: shapes only) never reach the kernel;
    the bfloat16 ranking equals the float32 one of the same values."""
    monkeypatch.setattr(evict_rows, "FUSED_DROP", True)
    spy = _Spy(evict_rows.kernel())
    monkeypatch.setattr(evict_rows, "kernel", lambda: spy)
    g = torch.Generator().manual_seed(0)
    scores = [torch.randint(0, 50, (2, 3, 33), generator=g).to(torch.bfloat16) for _ in range(3)]
    valid = torch.ones(2, 1, 33, dtype=torch.bool)
    got = score_ops.lowest_columns(scores, valid, None)
    assert spy.calls == []
    monkeypatch.setattr(evict_rows, "FUSED_DROP", True)
    assert torch.equal(got, score_ops.lowest_columns([t.float() for t in scores], valid, None))
    meta = [torch.empty(2, 3, 33, device="meta") for _ in range(3)]
    spy.calls.clear()
    out = score_ops.lowest_columns(meta, valid.to("meta"), None)
    assert out.shape == (6, 3, 1) and out.device.type == "meta" and spy.calls == []
    score_ops.add_group_sums(meta, [torch.empty(2, 6, 30, device="meta")] * 3, 3)
    assert spy.calls == []


def test_the_switch_off_runs_every_operation_in_torch(tmp_path, monkeypatch):
    """``VLKV_CPU_EVICT=0`` in a fresh interpreter: every operation runs (the kernel is never built
    or called) and gives the floats the kernel gives in this one."""
    script = tmp_path / "off.py"
    script.write_text(
        "import torch, vlkv.plugins.evict_rows as er\n"
        "from vlkv.runtime.kv import score_ops\n"
        "assert not er.FUSED_DROP\n"
        "er.kernel = lambda: (_ for _ in ()).throw(AssertionError('kernel asked'))\n"
        "g = torch.Generator().manual_seed(7)\n"
        "sc = [torch.rand(2, 3, 40, generator=g) for _ in range(3)]\n"
        "cs = [torch.rand(2, 6, 37, generator=g) for _ in range(3)]\n"
        "rg = [torch.randint(0, 3, (2, 3, 40), generator=g).float() for _ in range(3)]\n"
        "n = [torch.tensor([37, 20])] * 3\n"
        "score_ops.add_group_sums(sc, cs, 3)\n"
        "held = score_ops.text_step(rg, sc, cs, [37] * 3, n, 3)\n"
        "low = score_ops.lowest_columns(sc, torch.ones(2, 1, 40, dtype=torch.bool), None)\n"
        f"torch.save([sc, held, low], {str(tmp_path / 'off.pt')!r})\n"
    )
    env = {**os.environ, "VLKV_CPU_EVICT": "0", "PYTHONPATH": str(Path(vlkv.__file__).parents[1])}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    off = torch.load(tmp_path / "off.pt")
    _built()
    monkeypatch.setattr(evict_rows, "FUSED_DROP", True)  # this process may run with the switch off too
    g = torch.Generator().manual_seed(7)
    sc = [torch.rand(2, 3, 40, generator=g) for _ in range(3)]
    cs = [torch.rand(2, 6, 37, generator=g) for _ in range(3)]
    rg = [torch.randint(0, 3, (2, 3, 40), generator=g).float() for _ in range(3)]
    spy = _Spy(evict_rows.kernel())
    monkeypatch.setattr(evict_rows, "kernel", lambda: spy)
    score_ops.add_group_sums(sc, cs, 3)
    held = score_ops.text_step(rg, sc, cs, [37] * 3, [torch.tensor([37, 20])] * 3, 3)
    low = score_ops.lowest_columns(sc, torch.ones(2, 1, 40, dtype=torch.bool), None)
    assert spy.calls == ["add_group_sums", "avl_text_step", "lowest_columns"]
    for a, e in zip(off[0], sc, strict=True):
        assert torch.equal(a, e)
    assert torch.equal(off[1], held) and torch.equal(off[2], low)


@pytest.mark.parametrize("threads", [2, 3])
def test_one_parallel_region_over_every_layer_splits_inside_layers(threads, monkeypatch):
    """With several threads the kernels' one region over every layer's rows is split inside layers
    (45 rows in 3 layers of 15: at 2 threads tasks of 23 rows); the results equal the torch form's."""
    b, h, layers, s, group = 3, 5, 3, 729, 4
    g = torch.Generator().manual_seed(threads)
    tables = [torch.rand(b, h, s + 3, generator=g) for _ in range(layers)]
    regions = [torch.randint(0, 2, (b, h, s + 3), generator=g).float() for _ in range(layers)]
    colsums = _sums(b, h, group, s, layers, threads)
    lengths = [torch.tensor([s, s - 5, 3])] * layers
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, want = [t.clone() for t in tables], [t.clone() for t in tables]
        _run(monkeypatch, True, score_ops.add_group_sums, got, colsums, h)
        _run(monkeypatch, False, score_ops.add_group_sums, want, colsums, h)
        held = _run(monkeypatch, True, score_ops.text_step, regions, got, colsums, [s] * layers, lengths, h)
        ref = _run(monkeypatch, False, score_ops.text_step, regions, want, colsums, [s] * layers, lengths, h)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(held, ref)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)


def test_the_kernels_refuse_tables_that_share_memory_in_one_line():
    """Called directly (not through ``score_ops``, which takes torch there), the one-region kernels
    refuse a table listed twice and overlapping rows."""
    _built()
    t = torch.zeros(2, 3, 8)
    sums = [torch.zeros(2, 6, 8)] * 2
    with pytest.raises(RuntimeError, match="two tables share memory"):
        evict_rows.add_group_sums([t, t], sums, 2)
    with pytest.raises(RuntimeError, match="rows must not overlap"):
        evict_rows.add_group_sums([torch.zeros(2, 1, 8).expand(2, 3, 8)], sums[:1], 2)
    regions = [torch.ones(2, 3, 8)] * 2
    with pytest.raises(RuntimeError, match="two tables share memory"):
        evict_rows.avl_text_step(regions, [t, t], sums, [8, 8], [torch.tensor([8, 8])] * 2, 2)
    # a written table inside a table it reads (the colsum's buffer; restrict pointers must not alias)
    buf = torch.zeros(2, 6, 8)
    with pytest.raises(RuntimeError, match="two tables share memory"):
        evict_rows.add_group_sums([buf[:, :3]], [buf], 2)
    with pytest.raises(RuntimeError, match="two tables share memory"):
        evict_rows.avl_text_step([t], [buf[:, 3:]], [buf], [8], [torch.tensor([8, 8])], 2)
    # tables it only reads may share memory (one regions table for two layers)
    evict_rows.avl_text_step(regions, [t, torch.zeros(2, 3, 8)], sums, [8, 8], [torch.tensor([8, 8])] * 2, 2)


def test_tables_sharing_memory_with_what_they_read_take_torch(monkeypatch):
    """A score table that is a view of its own colsum's buffer: ``score_ops`` runs the torch form (the
    kernel would refuse it), which reads the colsum before it writes."""
    _built()
    monkeypatch.setattr(evict_rows, "FUSED_DROP", True)
    spy = _Spy(evict_rows.kernel())
    monkeypatch.setattr(evict_rows, "kernel", lambda: spy)
    buf = torch.rand(2, 6, 8, generator=torch.Generator().manual_seed(1))
    want = buf[:, :3].clone().add_(buf.view(2, 3, 2, 8).sum(2))
    score_ops.add_group_sums([buf[:, :3]], [buf], 3)
    assert spy.calls == []
    assert torch.equal(buf[:, :3], want)
