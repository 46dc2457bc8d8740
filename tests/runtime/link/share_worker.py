"""One process of the multi-process link test: linked requests on a shared store URL, in waves."""

from __future__ import annotations

SPEC_K = 2
NEW_TOKENS = 2


def image(i: int):
    """The ``i``-th seeded test photo (56 px: one tiny-llava image)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(10_000 + i)
    return Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))


def order(p: int, procs: int, per_proc: int, n_images: int) -> list[int]:
    """Image of each request of process ``p``: a stride-7 walk (7 is coprime with ``n_images``), each
    process starting elsewhere, so every image is asked first by one process and later by the others."""
    return [(i * 7 + p * (n_images // procs)) % n_images for i in range(per_proc)]


def link_worker(url: str, p: int, procs: int, per_proc: int, n_images: int, wave: int, barrier, out) -> None:
    import torch

    from vlkv.runtime.engine import Engine
    from vlkv.runtime.link.spec import LinkSpec
    from vlkv.runtime.models.registry import load_model
    from vlkv.runtime.policies import make_policy
    from vlkv.runtime.prompt import Prompt
    from vlkv.runtime.request import Request, Status
    from vlkv.runtime.scheduler import Scheduler
    from vlkv.runtime.store.remote import remote_faults
    from vlkv.runtime.store.url import open_store

    torch.set_num_threads(1)
    engine = Engine(load_model("tiny-llava"))
    store = open_store(url, host_bytes=0)  # remote tier only: a hit on another's record crossed the wire
    sched = Scheduler(engine, store=store, link_threshold=0.0)
    images = {k: image(k) for k in set(order(p, procs, per_proc, n_images))}
    reqs = []
    barrier.wait(timeout=120)
    for start in range(0, per_proc, wave):  # every wave is admitted at once: concurrent link requests
        for k in order(p, procs, per_proc, n_images)[start : start + wave]:
            req = Request(
                Prompt("What is it?", [images[k]]),
                make_policy("full"),
                NEW_TOKENS,
                stop_at_eos=False,
                link=LinkSpec("mpic", SPEC_K),
            )
            req.extras["image"] = k
            sched.submit(req)
            reqs.append(req)
        sched.run()
        sched.flush()  # written back before the next wave: the other processes may hit them now
    wrote = {r.extras["image"] for r in reqs if r.link_stats is not None and r.link_stats.misses}
    result = {
        "p": p,
        "answered": sum(r.status == Status.FINISHED and len(r.tokens) == NEW_TOKENS for r in reqs),
        "linked": sum(r.link_stats is not None for r in reqs),
        "remote_hits": sum(bool(r.link_stats and r.link_stats.bytes_loaded) for r in reqs),
        "others": sum(
            bool(r.link_stats and r.link_stats.bytes_loaded) and r.extras["image"] not in wrote for r in reqs
        ),
        "corrupt": store.stats.corrupt + store.stats.stale,
        "faults": remote_faults(store)[store.tiers[-1].name]["faults"],
        "tokens": [
            (r.extras["image"], bool(r.link_stats and r.link_stats.hits), list(r.tokens)) for r in reqs
        ],
    }
    barrier.wait(timeout=120)  # Mooncake: a process's records live in its segment until it leaves
    out.put(result)
    if hasattr(store.tiers[-1], "close"):
        store.tiers[-1].close()


def run_link_share(url: str, procs: int, per_proc: int, n_images: int, wave: int, timeout_s: float = 240.0):
    """``procs`` processes × ``per_proc`` linked requests on one store URL, started together."""
    from tests.runtime.store.servers import run_processes

    preload = ["tests.runtime.link.share_worker", "vlkv.runtime.engine"]
    return run_processes(
        link_worker, lambda p: (url, p, procs, per_proc, n_images, wave), procs, preload, timeout_s
    )
