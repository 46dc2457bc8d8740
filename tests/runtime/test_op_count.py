"""``count_ops`` counts a block's host syncs by kind, by the innermost ``vlkv`` module and by its function."""

from __future__ import annotations

import torch

from vlkv.plugins.paged_cpu_plan import shared_runs
from vlkv.runtime.op_count import count_ops


def test_syncs_are_counted_by_kind_module_and_site():
    row = torch.arange(5, 13).expand(2, 8)  # two heads holding the same run of slots
    with count_ops() as c:
        runs = shared_runs(row)
        x = torch.tensor([1.0, -2.0, 3.0])
        _ = x[x > 0]  # a boolean index (its length is read back), asked from outside vlkv
        _ = x.tolist()
    assert runs == [(0, 8, 5)]
    site = "vlkv.plugins.paged_cpu_plan:shared_runs"
    assert c.sites[site] == c.modules["vlkv.plugins.paged_cpu_plan"] >= 3  # two checks, the breaks, ...
    assert c.sites["?:?"] == c.modules["?"] == 2
    assert c.syncs == sum(c.sites.values()) == sum(c.kinds.values())
    # shared_runs: its breaks by a nonzero read back as a list; outside: the boolean index, the list
    assert c.kinds["bool_index"] == 1 and c.kinds["nonzero"] == 1 and c.kinds["tolist"] == 2
