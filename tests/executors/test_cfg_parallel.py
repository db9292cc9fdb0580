"""CFG parallel in replica groups, on CPU over gloo: the conditional rows on one half of a group,
the unconditional on the other, combined as the family's pipeline combines them; a group's
outputs equal one worker's, and bad layouts are refused."""

from __future__ import annotations

import pytest

from rollout import EngineConfig, RolloutEngine
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from tests.families import ALL_FAMILIES as FAMILIES

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5  # latents and log-probs of a group against one worker (the bound)
SHORT, LONG = "a red square", "a small blue circle on a wide green field, drawn at noon in soft light"


def _run(engine: RolloutEngine, family) -> dict:
    """Request id -> output of three requests at different steps in one batch, with CFG on and off
    and prompts of different lengths: "plain" (CFG off) runs alone for two steps (a batch without
    negative prompts), then "guided" and "guided_long" (CFG on) join it (a mixed batch), and run
    their last two steps on their own (every row guided)."""
    steps = {"num_inference_steps": 4, "seed": 5, "sampler": "flow_sde", "sde_window": (0, 3)}
    ids = engine.add_request(SHORT, family.params(cfg=False, **steps), request_id="plain")
    outputs = {}
    for _ in range(2):
        outputs |= {o.request_id: o for o in engine.step()}
    guided = family.params(cfg=True, **steps)
    ids += engine.add_request(SHORT, guided, request_id="guided", prompt_index=1)
    ids += engine.add_request(LONG, guided, request_id="guided_long", prompt_index=2)
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
    assert sorted(outputs) == sorted(ids)
    return outputs


def _assert_close(got: dict, want: dict) -> float:
    """The largest |difference| of latents and log-probs over every output."""
    worst = 0.0
    for request_id, w in want.items():
        g = got[request_id]
        worst = max(
            worst,
            float((g.trajectory.latents.stack() - w.trajectory.latents.stack()).abs().max()),
            float((g.trajectory.log_probs - w.trajectory.log_probs).abs().max()),
        )
        assert worst < TOLERANCE, (request_id, worst)
    return worst


def _halves(worker) -> tuple[str, int]:
    """Which passes the worker runs: its adapter's `guidance_passes` and its half."""
    passes = worker.adapter.guidance_passes
    return type(passes).__name__, passes.half


def _sharded(worker) -> bool:
    return all(module._parallel_config is not None for module in worker.adapter.denoisers.values())


@pytest.fixture(scope="module")
def reference(tiny_models):
    """family name -> outputs of `_run` on one in-process worker."""
    cache: dict = {}

    def outputs(name: str) -> dict:
        if name not in cache:
            with RolloutEngine(EngineConfig(model=tiny_models(name))) as engine:
                cache[name] = _run(engine, FAMILIES[name])
        return cache[name]

    return outputs


def _assert_rescored(trainer_adapter, outputs: dict) -> None:
    """A single-device trainer re-scores the group's rollouts within the contract's bound."""
    for output in outputs.values():
        trajectory = output.trajectory
        log_ratio = recompute_log_probs(trainer_adapter, trajectory) - trajectory.log_probs
        assert log_ratio.abs().max() < RATIO_TOLERANCE, output.request_id


# SD3: its pipeline runs both passes in one forward; FLUX.1 and Qwen-Image: true CFG (Qwen-Image's
# norm rescale); Wan 2.2: both experts, each with its own scale (guidance_scale, guidance_scale_2).
@pytest.mark.slow  # two worker processes: ~50 s of CPU on the 2-core machine, past the default budget
@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "wan22"])
def test_a_cfg_parallel_group_of_two_ranks_equals_one_worker(tiny_models, reference, trainer_adapters, family):
    config = EngineConfig(model=tiny_models(family), executor="mp", num_workers=2, cfg_parallel=2)
    with RolloutEngine(config) as engine:
        got = _run(engine, FAMILIES[family])
        worst = _assert_close(got, reference(family))
        assert engine.collective_rpc(_halves) == [("CfgParallelPasses", 0), ("CfgParallelPasses", 1)]
        assert engine.collective_rpc("request_ids") == [[], []]  # the other half kept no finished state
    print(f"{family}: cfg_parallel=2 vs one worker, max |diff| {worst:.2e}")
    _assert_rescored(trainer_adapters(family), got)


@pytest.mark.slow  # four processes
def test_two_replicas_of_a_cfg_parallel_group_equal_one_worker(tiny_models, reference, trainer_adapters):
    config = EngineConfig(model=tiny_models("qwen_image"), executor="mp", num_workers=4, cfg_parallel=2)
    with RolloutEngine(config) as engine:
        assert (engine.config.num_replicas, engine.config.ranks_per_replica) == (2, 2)
        got = _run(engine, FAMILIES["qwen_image"])
        worst = _assert_close(got, reference("qwen_image"))
        assert [half for _, half in engine.collective_rpc(_halves)] == [0, 1, 0, 1]
    print(f"qwen_image: 2 replicas x cfg_parallel=2 vs one worker, max |diff| {worst:.2e}")
    _assert_rescored(trainer_adapters("qwen_image"), got)


@pytest.mark.slow  # four processes
def test_cfg_parallel_times_ulysses_equals_one_worker(tiny_models, reference, trainer_adapters):
    """A group of 2 x 2 ranks: each half shards its pass over its own Ulysses pair."""
    config = EngineConfig(model=tiny_models("flux"), executor="mp", num_workers=4, cfg_parallel=2, sequence_parallel=2)
    with RolloutEngine(config) as engine:
        assert (engine.config.num_replicas, engine.config.ranks_per_replica) == (1, 4)
        got = _run(engine, FAMILIES["flux"])
        worst = _assert_close(got, reference("flux"))
        assert [half for _, half in engine.collective_rpc(_halves)] == [0, 0, 1, 1]
        assert engine.collective_rpc(_sharded) == [True] * 4
    print(f"flux: cfg_parallel=2 x sequence_parallel=2 vs one worker, max |diff| {worst:.2e}")
    _assert_rescored(trainer_adapters("flux"), got)


@pytest.mark.slow  # a Ray cluster and two actors in a gloo group
def test_a_cfg_parallel_group_of_two_ray_actors_equals_one_worker(ray_cluster, tiny_models, reference):
    config = EngineConfig(model=tiny_models("flux"), executor="ray", num_workers=2, cfg_parallel=2)
    with RolloutEngine(config) as engine:
        _assert_close(_run(engine, FAMILIES["flux"]), reference("flux"))


def test_cfg_parallel_layouts_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match=r"cfg_parallel must be 1 or 2.*got 3"):
        EngineConfig(model="x", executor="mp", num_workers=3, cfg_parallel=3)
    with pytest.raises(
        ValueError, match=r"num_workers=3 is not replicas x ranks.*cfg_parallel=2 ranks.*multiple of 2"
    ):
        EngineConfig(model="x", executor="mp", num_workers=3, cfg_parallel=2)
    product = r"cfg_parallel=2 x sequence_parallel=2 = 4 ranks, so num_workers must be a multiple of 4"
    with pytest.raises(ValueError, match=product):
        EngineConfig(model="x", executor="mp", num_workers=6, cfg_parallel=2, sequence_parallel=2)
    with pytest.raises(ValueError, match=r"num_workers=1 is not replicas x ranks.*multiple of 2"):
        EngineConfig(model="x", cfg_parallel=2)  # 'uni' runs one rank, half a group
    config = EngineConfig(model="x", executor="mp", num_workers=8, cfg_parallel=2, sequence_parallel=2)
    assert (config.num_replicas, config.ranks_per_replica) == (2, 4)


def test_uni_cannot_run_a_cfg_parallel_group(tiny_models):
    with pytest.raises(ValueError, match="executor 'uni' runs one in-process worker"):
        RolloutEngine(EngineConfig(model=tiny_models("sd3"), num_workers=2, cfg_parallel=2))


def test_the_server_and_the_recipes_take_cfg_parallel():
    from recipes.config import EngineSection
    from rollout.serve.__main__ import engine_flag_names, parse_args
    from rollout.serve.setting_flags import settings_from_args

    args = parse_args(["--model", "m", "--executor", "mp", "--num-workers", "4", "--cfg-parallel", "2"])
    config = EngineConfig(**settings_from_args(args, engine_flag_names()))
    assert (config.cfg_parallel, config.num_replicas, config.ranks_per_replica) == (2, 2, 2)
    assert EngineSection(executor="mp", num_workers=4, cfg_parallel=2).to_engine_config("m").cfg_parallel == 2
    with pytest.raises(ValueError, match="num_workers=3 is not replicas x ranks per replica"):
        EngineSection(executor="mp", num_workers=3, cfg_parallel=2)


@pytest.mark.slow  # two spawned processes that import torch: 14 s wall on the loaded 2-core machine
@pytest.mark.timeout(120)
def test_the_halves_of_a_pair_share_their_passes_and_fail_together(tmp_path):
    """Two gloo processes and a stand-in forward (no model): both halves end with what one process
    computes; a pass that fails on one half raises on both at once, not at the group's timeout."""
    import torch
    import torch.multiprocessing as mp

    from tests.executors.cfg_pair import passes_of_one_rank

    mp.spawn(passes_of_one_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    conditional, unconditional = (torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2))
    for outcome in (conditional, unconditional):
        (cond, uncond), (want_cond, want_uncond) = outcome["got"], outcome["want"]
        assert cond.equal(want_cond) and uncond.equal(want_uncond)
        cond, uncond = outcome["no_negatives"]  # the conditional half's pass, shared
        assert cond.equal(want_cond) and uncond is None
    assert unconditional["error"] == "ValueError: injected failure for ''"
    assert conditional["error"].startswith("RuntimeError: the unconditional pass of classifier-free guidance failed")
