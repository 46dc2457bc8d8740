"""Device correctness without a GPU: nothing the engine, pool, scheduler, policies or backend create
lands on a device other than the pool's.

Inside ``with torch.device("meta")`` every factory call that names no device makes a *meta* tensor
(shape only, no data); mixing one with the pool's CPU tensors, or reading its value, raises. So a run
that finishes here names a device at every tensor it creates — on a GPU the same code keeps every
tensor on the GPU. Prompt encoding (the HF processor, host-side by design) runs before the block.
"""

from __future__ import annotations

import pytest
import torch

from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt
from vlkv.runtime.request import Request, Status
from vlkv.runtime.scheduler import Scheduler

POLICIES = {
    "full": {},
    "h2o": {"budget": 0.4},
    "snapkv": {"budget": 0.4},
    "local": {"budget": 0.4},
    "elastic": {"budget": 0.4},
    "vlcache": {"budget": 0.4},
    "avl": {"budget": 0.5, "core": 0.3, "prefill_keep": 0.8, "filter_layer": 1},
    "pyramidkv": {"budget": 0.4},
}


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_path_creates_a_tensor_off_the_pool_device(policy, name, engines, images):
    engine = engines[name]
    sched = Scheduler(engine)
    reqs = [
        sched.submit(
            Request(Prompt(text, imgs), make_policy(policy, **POLICIES[policy]), 4, stop_at_eos=False)
        )
        for text, imgs in [
            ("Describe it.", [images[0]]),
            ("Two of them?", [images[1], images[2]]),
            ("Hi", []),
        ]
    ]
    with torch.device("meta"):
        sched.run()
    for r in reqs:
        assert r.status is Status.FINISHED, r.error
        assert len(r.tokens) == 4


@pytest.fixture(scope="module")
def cuda_engine():
    from vlkv.runtime.engine import Engine
    from vlkv.runtime.models.registry import load_model

    return Engine(load_model("tiny-llava", device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_on_the_gpu(policy, cuda_engine, engines, images):
    sched = Scheduler(cuda_engine)
    prompts = [Prompt("Describe it.", [images[0]]), Prompt("Two of them?", [images[1], images[2]])]
    reqs = [
        sched.submit(Request(p, make_policy(policy, **POLICIES[policy]), 8, stop_at_eos=False))
        for p in prompts
    ]
    sched.run()
    assert sched.pool.keys[0].device.type == "cuda"
    cpu = engines["tiny-llava"].generate(
        prompts, make_policy(policy, **POLICIES[policy]), 8, stop_at_eos=False
    )
    for r, want in zip(reqs, cpu.samples):
        assert r.status is Status.FINISHED, r.error
        # float32 on both; kernels differ, so compare the first tokens, where ties are unlikely
        assert r.tokens[:4] == want.token_ids[:4]
