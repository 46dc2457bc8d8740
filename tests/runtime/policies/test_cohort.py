"""``policies.cohort``: equal policies run their decode bookkeeping once for all of their requests in a
scheduler step, whatever the requests' lengths and table capacities (the common case: a serving step's
requests hold different lengths, some evicting at a step where others do not), and every request's
tokens and cache stay those of its solo run."""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.policies import cohort, make_policy
from vlkv.runtime.policies.base import CutEdit, DropOneEdit, LayerEdit
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler

SPECS = [
    ("h2o", {"budget": 0.5}),
    ("h2o", {"budget": 0.4, "evict_every": 3}),
    ("avl", {"budget": 0.5, "core": 0.3}),
    ("avl", {"budget": 0.5, "text_min": 2}),
    ("local", {"budget": 0.4}),
    ("elastic", {"budget": 0.5}),
]


@pytest.fixture
def cohort_runs(monkeypatch):
    """The sizes of the cohorts whose one policy call returned (its edits split per request)."""
    sizes = []
    split = cohort.split_edits

    def counted(edits, n, *args):
        sizes.append(n)
        return split(edits, n, *args)

    monkeypatch.setattr(cohort, "split_edits", counted)
    return sizes


@pytest.mark.parametrize(
    ("name", "kw"), SPECS, ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in SPECS]
)
def test_a_cohort_decodes_as_each_request_alone(name, kw, engines, images, cohort_runs):
    engine = engines["tiny-llava"]
    prompt = Prompt("Describe the picture in detail, every part.", [images[0]])
    solo = engine.generate([prompt], make_policy(name, **kw), 12, stop_at_eos=False)
    sched = Scheduler(engine)
    # three of one prompt and one shorter other in the same decode steps: one cohort of four
    reqs = [sched.submit(Request(prompt, make_policy(name, **kw), 12, stop_at_eos=False)) for _ in range(3)]
    other = Prompt("Hi", [images[1]])
    reqs.append(sched.submit(Request(other, make_policy(name, **kw), 12, stop_at_eos=False)))
    other_solo = engine.generate([other], make_policy(name, **kw), 12, stop_at_eos=False)
    sched.run()
    assert cohort_runs and max(cohort_runs) == 4, cohort_runs
    for r in reqs[:3]:
        assert r.status is Status.FINISHED, r.error
        assert r.tokens == solo.samples[0].token_ids
        assert r.final["kept_per_layer"] == reqs[0].final["kept_per_layer"]
    assert reqs[3].tokens == other_solo.samples[0].token_ids
    assert sched.pool.used_bytes() == 0


RAGGED = [
    ("Describe the picture in detail, every part of it please.", 0),
    ("Hi", 1),
    ("What is in it?", 2),
    ("Tell me what the picture shows and why.", 0),
]


@pytest.mark.parametrize(
    ("name", "kw"), SPECS, ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in SPECS]
)
def test_a_ragged_cohort_decodes_as_each_request_alone(name, kw, engines, images, monkeypatch, cohort_runs):
    """Four prompts of different lengths (different table capacities, each request evicting at its own
    steps, mid-eviction beside rows keeping all): one cohort a step, every request's tokens those of its
    solo run, its final kept counts those of the same scheduler run without cohorts."""
    engine = engines["tiny-llava"]
    prompts = [Prompt(text, [images[i]]) for text, i in RAGGED]
    solos = [engine.generate([p], make_policy(name, **kw), 10, stop_at_eos=False) for p in prompts]
    finals = []
    for batched in (True, False):
        if not batched:
            assert cohort_runs and max(cohort_runs) == len(prompts), cohort_runs
            cohort_runs.clear()
            monkeypatch.setattr(cohort, "cohorts", lambda entries: [[i] for i in range(len(entries))])
        sched = Scheduler(engine)
        reqs = [sched.submit(Request(p, make_policy(name, **kw), 10, stop_at_eos=False)) for p in prompts]
        sched.run()
        for r, solo in zip(reqs, solos):
            assert r.status is Status.FINISHED, r.error
            assert r.tokens == solo.samples[0].token_ids
        assert sched.pool.used_bytes() == 0
        finals.append([r.final["kept_per_layer"] for r in reqs])
    assert not cohort_runs
    assert finals[0] == finals[1]
    assert len({tuple(f) for f in finals[0]}) > 1  # the rows really held different lengths


def _states(reqs) -> list:
    """Per request and layer: its host lengths, capacity, slot ids and running score tables (copies)."""
    return [
        [
            (
                layer.host_lengths(),
                layer.capacity,
                layer.slots[:, :, : layer.max_length].clone(),
                {k: v.clone() for k, v in layer.scores.items()},
            )
            for layer in r.cache.layers
        ]
        for r in reqs
    ]


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("avl", {"budget": 0.5, "core": 0.3}),
        ("h2o", {"budget": 0.5}),
        ("h2o", {"budget": 0.4, "evict_every": 3}),
    ],
    ids=["avl-core", "h2o", "h2o-every3"],
)
@pytest.mark.parametrize("ragged", [False, True], ids=["equal", "ragged"])
def test_a_cohort_keeps_the_running_scores_each_request_keeps_alone(
    name, kw, ragged, engines, images, monkeypatch, cohort_runs
):
    """The same requests stepped with their bookkeeping batched and one request at a time (the same
    decode batches, so the same statistics): at every step every score table, length, capacity and slot
    id bit for bit equal — two of one prompt, or three prompts of different lengths."""

    engine = engines["tiny-llava"]
    if ragged:
        prompts = [Prompt(text, [images[i]]) for text, i in RAGGED[:3]]
    else:
        prompts = [Prompt("Describe the picture in detail, every part.", [images[2]])] * 2
    runs = []
    for batched in (True, False):
        if not batched:
            assert cohort_runs and max(cohort_runs) == len(prompts)  # the batched run stacked them all
            monkeypatch.setattr(cohort, "cohorts", lambda entries: [[i] for i in range(len(entries))])
        sched = Scheduler(engine)
        reqs = [sched.submit(Request(p, make_policy(name, **kw), 8, stop_at_eos=False)) for p in prompts]
        states = []
        for _ in range(6):
            sched.step()
            states.append(_states(reqs))
        runs.append(states)
        for r in reqs:
            sched.cancel(r)
    for mine_step, alone_step in zip(*runs):
        for mine, alone in zip(mine_step, alone_step):
            for (n, cap, slots, scores), (m, cap_alone, slots_alone, want) in zip(mine, alone):
                assert n == m and cap == cap_alone and torch.equal(slots, slots_alone)
                assert scores.keys() == want.keys()
                for k in scores:
                    assert torch.equal(scores[k][:, :, : n[0]], want[k][:, :, : m[0]]), k


def test_cohorts_group_equal_policies_on_dense_caches_only(engines, images):
    engine = engines["tiny-llava"]
    sched = Scheduler(engine)
    long, short = Prompt("Describe the picture in detail.", [images[0]]), Prompt("Hi", [images[0]])
    specs = [(long, 0.5), (long, 0.5), (short, 0.5), (long, 0.4), (long, 0.5), (short, 0.5)]
    for p, b in specs:
        sched.submit(Request(p, make_policy("h2o", budget=b), 8, stop_at_eos=False))
    sched.step()
    entries = sched._entries()
    # lengths and capacities differ between the two prompts: one cohort of the equal policies
    assert len({e.request.cache.layers[0].capacity for e in entries}) > 1
    assert cohort.cohorts(entries) == [[0, 1, 2, 4, 5], [3]]
    # a cache with per-head holes (or low-rank factors) stays alone: its edits rebuild the tables
    layer = entries[5].request.cache.layers[1]
    layer.holes = torch.zeros(layer.slots.shape, dtype=torch.bool)
    assert cohort.cohorts(entries) == [[0, 1, 2, 4], [3], [5]]
    layer.holes = None
    # a policy that does not declare a batched decode hook stays alone
    for e in entries:
        e.request.policy = make_policy("snapkv", budget=0.5)
    assert cohort.cohorts(entries) == [[0], [1], [2], [3], [4], [5]]


def test_split_edits_gives_each_request_its_rows():
    b, h = 3, 2
    keep_len = torch.tensor([4, 3, 4])
    index = torch.arange(b * h * 5).view(b, h, 5)
    dropped = torch.arange(b * h).view(b, h, 1)
    edits = [
        None,
        DropOneEdit(5, keep_len, [4, 3, 4], dropped),
        LayerEdit(index, keep_len, kept=[4, 3, 4], dropped=dropped),
        CutEdit(torch.tensor([1, 2, 3]), torch.tensor([1, 0, 2]), ([1, 2, 3], [1, 0, 2])),
    ]
    per = cohort.split_edits(edits, b)
    assert len(per) == b
    for r, mine in enumerate(per):
        assert mine[0] is None
        one, sel, cut = mine[1:]
        assert isinstance(one, DropOneEdit) and one.width == 5 and one.kept == [int(keep_len[r])]
        assert torch.equal(one.dropped, dropped[r : r + 1]) and torch.equal(one.keep_len, keep_len[r : r + 1])
        assert torch.equal(one.index, DropOneEdit(5, keep_len, None, dropped).index[r : r + 1])
        # the index cut to the row's own kept count (the width its ranking alone returns)
        assert torch.equal(sel.index, index[r : r + 1, :, : int(keep_len[r])]) and sel.kept == [
            int(keep_len[r])
        ]
        assert torch.equal(sel.dropped, dropped[r : r + 1]) and sel.assign is None
        assert cut.host == ([[1, 2, 3][r]], [[1, 0, 2][r]]) and int(cut.start) == [1, 2, 3][r]
    assert cohort.split_edits(None, b) == [None] * b


def test_split_edits_gives_rows_keeping_everything_no_edit_and_their_own_widths():
    """Rows of different lengths: a row keeping all it holds gets None (as alone, where its selection is
    never made), a one-column drop the row's own width, a selection's index its own kept count."""
    held = [6, 4, 5]
    dropped = torch.tensor([1, 0, 2]).view(3, 1, 1).expand(3, 2, 1)
    index = torch.arange(5).expand(3, 2, 5)
    edits = [
        DropOneEdit(6, torch.tensor([5, 4, 4]), [5, 4, 4], dropped),
        LayerEdit(index, torch.tensor([5, 4, 3]), kept=[5, 4, 3]),
        CutEdit(torch.tensor([1, 1, 1]), torch.tensor([1, 0, 2]), ([1, 1, 1], [1, 0, 2])),
    ]
    per = cohort.split_edits(edits, 3, [held] * 3)
    one, sel, cut = zip(*per)
    assert one[1] is None and sel[1] is None and cut[1] is None  # row 1 keeps its 4
    assert [e.width for e in (one[0], one[2])] == [6, 5]
    assert torch.equal(one[2].index, torch.tensor([0, 1, 3, 4]).expand(1, 2, 4))
    assert sel[0].index.shape[2] == 5 and torch.equal(sel[2].index, index[2:3, :, :3])
    assert cut[0].host == ([1], [1]) and cut[2].host == ([1], [2])


def test_a_cohorts_attend_lists_are_each_requests_own(engines, images):
    """A-VL's core attention listed for a ragged cohort in one pass (``cohort_attends``): every request's
    lists equal its own ``decode_attend`` — the same layers restricted, the same indices (its own width)
    and counts — at steps restricting the core and at the refresh steps (no lists)."""
    engine = engines["tiny-llava"]
    sched = Scheduler(engine)
    for text, i in RAGGED[:3]:
        policy = make_policy("avl", budget=0.5, core=0.2, text_min=2)
        sched.submit(Request(Prompt(text, [images[i]]), policy, 8, stop_at_eos=False))
    restricted = 0
    for _ in range(5):
        sched.step()
        entries = sched._entries()
        batched = cohort.cohort_attends(entries)
        assert sorted(batched) == list(range(len(entries)))
        for i, e in enumerate(entries):
            alone = e.request.policy.decode_attend(e.request.cache, e.ctx)
            mine = batched[i]
            assert (mine is None) == (alone is None)
            if alone is None:
                continue
            for a, b in zip(mine, alone, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    restricted += 1
                    assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths)
    assert restricted  # some step listed a core
