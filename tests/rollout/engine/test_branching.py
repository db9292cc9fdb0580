"""Tree rollouts: a path splits before each branch step into children that share its history
bitwise and then diverge; one output per leaf; subtrees abort on their own; prefixes are shared."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.engine.async_engine import AsyncRolloutEngine
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from rollout.seeding import derive_seed

pytestmark = pytest.mark.timeout(120)

TREE = SamplingParams(num_inference_steps=5, num_samples=2, seed=7, branch_steps=(1, 3), branch_factor=3)


@pytest.fixture(scope="module")
def tree(engine):
    return engine.generate(["a red square", "a blue circle"], TREE)


def test_one_output_per_leaf_in_prompt_root_path_order(tree):
    paths = list(itertools.product(range(3), repeat=2))
    assert [(o.prompt_index, o.sample_index, o.branch_path) for o in tree] == [
        (p, k, path) for p in range(2) for k in range(2) for path in paths
    ]
    assert tree[0].request_id == "req0-0.0.0" and tree[-1].request_id.endswith("-1.2.2")
    assert all(o.status == "finished" and o.trajectory.num_steps == 5 for o in tree)


def test_children_share_their_parents_latents_up_to_the_branch_step_and_differ_after(tree):
    for a, b in itertools.combinations(tree[:18], 2):  # the two roots of the first prompt
        la, lb = a.trajectory.latents.stack(), b.trajectory.latents.stack()
        if a.sample_index != b.sample_index:
            assert torch.equal(la[0], lb[0]) is False  # different roots start from different noise
            continue
        common = next(d for d in range(3) if d == 2 or a.branch_path[d] != b.branch_path[d])
        split = TREE.branch_steps[common]  # they diverge in the step at this index
        assert torch.equal(la[: split + 1], lb[: split + 1])
        assert torch.equal(a.trajectory.log_probs[:split], b.trajectory.log_probs[:split])
        assert not torch.equal(la[split + 1], lb[split + 1])
        assert a.trajectory.log_probs[split] != b.trajectory.log_probs[split]


def test_seeds_derive_from_the_branch_path_and_the_same_seeds_give_the_same_tree(engine, tree):
    for output in tree:
        stream = "step" + "".join(f"/{c}" for c in output.branch_path)
        assert output.seed == derive_seed(7, output.prompt_index, output.sample_index, stream)
    again = engine.generate(["a red square", "a blue circle"], TREE)
    for a, b in zip(tree, again, strict=True):
        assert torch.equal(a.trajectory.latents.stack(), b.trajectory.latents.stack())
        assert torch.equal(a.image, b.image)


def test_every_leaf_rescores_with_ratio_one(tree, trainer_adapter):
    for output in tree:
        log_ratio = recompute_log_probs(trainer_adapter, output.trajectory) - output.trajectory.log_probs
        assert log_ratio.abs().max() < RATIO_TOLERANCE


def test_the_shared_prefix_is_one_tensor_however_the_leaves_finished(tiny_model):
    # Batches of 2 split the 9 leaves of a root over several steps and worker calls.
    with RolloutEngine(EngineConfig(model=tiny_model, max_batch_size=2)) as engine:
        batches = []
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda *args: batches.append(schedule(*args)) or batches[-1]
        leaves = engine.generate(
            "x", SamplingParams(num_inference_steps=5, seed=1, branch_steps=(1, 3), branch_factor=3)
        )
    # Batches of at most 2: the 9 leaves finished in at least 5 different steps.
    assert max(len(w.step_ids) for out in batches for w in out.worker_inputs.values()) == 2
    roots = {id(o.trajectory.latents.parts[0]) for o in leaves}
    assert len(roots) == 1  # the root's history (x_0, x_1), once for all 9 leaves
    for first in range(3):
        middle = {id(o.trajectory.latents.parts[1]) for o in leaves if o.branch_path[0] == first}
        assert len(middle) == 1
    total = sum(o.trajectory.latents.nbytes for o in leaves)
    unique = sum({id(p): p.nbytes for o in leaves for p in o.trajectory.latents.parts}.values())
    assert unique < 0.65 * total  # 2 + 3 * 2 + 9 * 2 entries held instead of 9 * 6


def test_branching_at_an_ode_step_is_refused():
    with pytest.raises(ValueError, match=r"branch_steps \[1\] are ODE steps"):
        SamplingParams(num_inference_steps=4, sde_window=(2, 4), branch_steps=(1, 2))
    with pytest.raises(ValueError, match="ODE steps"):
        SamplingParams(sampler="ode", noise_level=0.0, branch_steps=(0,))
    with pytest.raises(ValueError, match="ODE steps"):  # CPS's last step is deterministic
        SamplingParams(num_inference_steps=3, sampler="cps", branch_steps=(2,))
    with pytest.raises(ValueError, match=r"branch_steps must be step indices in \[0, 4\)"):
        SamplingParams(num_inference_steps=4, branch_steps=(4,))
    with pytest.raises(ValueError, match="branch_steps must be increasing"):
        SamplingParams(branch_steps=(3, 1))
    with pytest.raises(ValueError, match="branch_factor must be >= 2"):
        SamplingParams(branch_steps=(1,), branch_factor=1)


def test_a_leaf_aborted_before_its_branch_exists_is_never_made(engine):
    params = SamplingParams(num_inference_steps=4, num_samples=1, seed=2, branch_steps=(2,), branch_factor=3)
    ids = engine.add_request("x", params, request_id="early")
    engine.step()  # the root has not split yet
    aborted = engine.abort("early-0.1")
    assert [(o.request_id, o.status, o.branch_path) for o in aborted] == [("early-0.1", "aborted", (1,))]
    assert aborted[0].seed == derive_seed(2, 0, 0, "step/1")  # the seed the leaf would have drawn with
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        assert "early-0.1" not in {i for held in engine.collective_rpc("request_ids") for i in held}
    assert [o.request_id for o in outputs] == [ids[0], ids[2]]
    assert engine.collective_rpc("request_ids") == [[]]


def test_aborting_every_leaf_one_by_one_drops_the_root(engine):
    params = SamplingParams(num_inference_steps=4, seed=2, branch_steps=(2,), branch_factor=2)
    ids = engine.add_request("x", params, request_id="gone")
    engine.step()
    assert [o.request_id for o in engine.abort(ids[0])] == [ids[0]]
    assert [o.request_id for o in engine.abort(ids[1])] == [ids[1]]
    assert not engine.has_unfinished_requests()
    engine.step()
    assert engine.collective_rpc("request_ids") == [[]]


def test_a_group_abort_ends_every_leaf(engine):
    params = SamplingParams(num_inference_steps=4, num_samples=2, seed=2, branch_steps=(0,), branch_factor=2)
    ids = engine.add_request("x", params, request_id="all")
    engine.step()
    aborted = engine.abort("all")
    assert sorted(o.request_id for o in aborted) == sorted(ids)
    assert engine.collective_rpc("request_ids") == [[]] and not engine.has_unfinished_requests()


def test_a_request_id_with_a_dot_is_refused(engine):
    with pytest.raises(ValueError, match="holds '.', which names tree branches"):
        engine.add_request("x", SamplingParams(), request_id="a.b")


def test_the_async_engine_streams_every_leaf(engine):
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=5, branch_steps=(1,), branch_factor=2)
    expected = engine.generate(["x"], params)

    async def run():
        async_engine = AsyncRolloutEngine(engine)
        try:
            return await async_engine.generate(["x"], params)
        finally:
            async_engine._calls.put(None)  # stop the thread, keep the shared engine open
            async_engine._thread.join()

    got = asyncio.run(run())
    assert [(o.sample_index, o.branch_path) for o in got] == [(o.sample_index, o.branch_path) for o in expected]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.trajectory.latents.stack(), b.trajectory.latents.stack())
