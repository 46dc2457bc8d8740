"""Engine.generate stopping rules."""

from __future__ import annotations

from vlkv.runtime.engine import Engine
from vlkv.runtime.policies import make_policy
from vlkv.runtime.prompt import Prompt


def test_stop_at_eos_is_per_call(loaded_models, images):
    engine = Engine(loaded_models["tiny-llava"])  # private: the eos set is changed below
    prompts = [Prompt("Describe.", [images[0]]), Prompt("Two?", [images[1], images[2]])]
    free = engine.generate(prompts, make_policy("full"), 6, stop_at_eos=False)
    first = free.samples[0].token_ids[0]
    engine.eos_ids = {first}  # sample 0's first token now ends it
    stopped = engine.generate(prompts, make_policy("full"), 6)
    assert stopped.samples[0].token_ids == [first]
    assert len(stopped.samples[1].token_ids) <= 6
    again = engine.generate(prompts, make_policy("full"), 6, stop_at_eos=False)
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in free.samples]
