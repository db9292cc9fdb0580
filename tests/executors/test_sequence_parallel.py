"""Replica groups with sequence parallel (Ulysses, through diffusers' context parallelism) on CPU
over gloo: a group's outputs equal one worker's, whatever the layout; bad layouts are refused."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from executors.replica_groups import ReplicaLayout
from rollout import EngineConfig, RolloutEngine
from rollout.errors import EngineDeadError
from rollout.parallel.group_failures import FAILURE_GRACE_S
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from tests.executors.worker_functions import (
    fail_inside_the_forward,
    fail_requests_of,
    slow_down_steps,
    wait_gone,
    worker_pid,
)
from tests.families import ALL_FAMILIES as FAMILIES

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5  # latents and log-probs of a group against one worker (the bound)
PROMPTS = ["a red square", "a small blue circle on a wide green field, drawn at noon in soft light"]


def _run(engine: RolloutEngine, family, cfg: bool) -> dict:
    """Sample id -> output: two prompts of different lengths, with and without CFG per the
    family, the second prompt added two steps after the first (one batch, different steps)."""
    params = family.params(
        cfg=cfg, num_inference_steps=4, num_samples=2, seed=5, sampler="flow_sde", sde_window=(0, 3)
    )
    ids = engine.add_request(PROMPTS[0], params, request_id="first")
    outputs = {}
    for _ in range(2):
        outputs |= {o.request_id: o for o in engine.step()}
    ids += engine.add_request(PROMPTS[1], params, request_id="second", prompt_index=1)
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
    assert sorted(outputs) == sorted(ids)
    return outputs


def _sharded(worker) -> bool:
    """Whether diffusers' context parallelism is on for every denoiser of the worker."""
    return all(module._parallel_config is not None for module in worker.adapter.denoisers.values())


def _assert_close(got: dict, want: dict) -> None:
    for request_id, w in want.items():
        g = got[request_id]
        assert (g.trajectory.latents.stack() - w.trajectory.latents.stack()).abs().max() < TOLERANCE, request_id
        assert (g.trajectory.log_probs - w.trajectory.log_probs).abs().max() < TOLERANCE, request_id
        assert g.trajectory.sde_mask.any()


@pytest.fixture(scope="module")
def reference(tiny_models):
    """family name -> cfg -> outputs of one in-process worker."""
    cache: dict = {}

    def outputs(name: str, cfg: bool) -> dict:
        if (name, cfg) not in cache:
            with RolloutEngine(EngineConfig(model=tiny_models(name))) as engine:
                cache[(name, cfg)] = _run(engine, FAMILIES[name], cfg)
        return cache[(name, cfg)]

    return outputs


@pytest.mark.slow  # two worker processes: ~50 s of CPU on the 2-core machine, past the default budget
@pytest.mark.parametrize("family", ["flux", "wan22"])  # Wan 2.2: both experts sharded
def test_a_group_of_two_ranks_equals_one_worker(tiny_models, reference, family):
    config = EngineConfig(model=tiny_models(family), executor="mp", num_workers=2, sequence_parallel=2)
    with RolloutEngine(config) as engine:
        for cfg in (False, True):
            _assert_close(_run(engine, FAMILIES[family], cfg), reference(family, cfg))
        assert engine.collective_rpc("request_ids") == [[], []]  # the follower kept no finished state
        assert engine.collective_rpc(_sharded) == [True, True]


@pytest.mark.slow  # four processes
@pytest.mark.parametrize("family", ["flux", "qwen_image", "wan"])
def test_two_replicas_of_two_ranks_equal_one_worker(tiny_models, reference, trainer_adapters, family):
    config = EngineConfig(model=tiny_models(family), executor="mp", num_workers=4, sequence_parallel=2)
    with RolloutEngine(config) as engine:
        for cfg in (False, True):
            got = _run(engine, FAMILIES[family], cfg)
            _assert_close(got, reference(family, cfg))
        checksums = engine.collective_rpc("weights_checksum", args=("transformer",))
        assert len(set(checksums)) == 1
        assert engine.collective_rpc(_sharded) == [True] * 4  # diffusers' hooks run on every rank
    for output in got.values():  # a single-device trainer re-scores the group's rollout
        trajectory = output.trajectory
        log_ratio = recompute_log_probs(trainer_adapters(family), trajectory) - trajectory.log_probs
        assert log_ratio.abs().max() < RATIO_TOLERANCE


def test_a_replica_s_step_goes_to_every_rank_of_its_group_and_its_leader_answers(tmp_path):
    """Over the scripted transport (no process, no model): the base's routing of steps and RPCs,
    and the rendezvous folder's lifetime."""
    from rollout.messages import RunnerOutput, SchedulerOutput, WorkerInput
    from tests.executors.fake_executor import Answer, ScriptedExecutor

    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    config = EngineConfig(model=str(tmp_path), executor=ScriptedExecutor, num_workers=4, sequence_parallel=2)
    executor = ScriptedExecutor(config)
    executor.script("execute", Answer(RunnerOutput(failed={"a": "leader's"})), ranks=[2])
    outputs = executor.execute(SchedulerOutput({0: WorkerInput(), 1: WorkerInput(step_ids=["a"])}))
    assert outputs == [RunnerOutput(), RunnerOutput(failed={"a": "leader's"})]  # one per replica
    assert [rank for name, rank in executor.log.sent if name == "execute"] == [2, 3]
    assert executor.workers[3].steps == [WorkerInput(step_ids=["a"])]  # the follower ran the same step
    assert executor.collective_rpc("get_rank") == [0, 1, 2, 3]  # RPCs address every rank
    members = [executor.rendezvous.member(rank) for rank in range(4)]
    assert [(m.group, m.local_rank, m.replies) for m in members] == [
        (0, 0, True),
        (0, 1, False),
        (1, 0, True),
        (1, 1, False),
    ]
    assert members[0].store_path == members[1].store_path != members[2].store_path
    folder = executor.rendezvous.folder
    assert os.path.isdir(folder)
    executor.shutdown()
    assert not os.path.exists(folder)


def test_a_step_failed_on_one_rank_of_a_group_kills_the_engine_and_names_the_rank(tmp_path):
    """Over the scripted transport: rank 1 fails its step and rank 0 never answers (it waits in a
    collective); the base reports rank 1's error, not a timeout, and stops every worker. A follower
    that dropped a request its leader kept is out of step too."""
    from rollout.messages import RunnerOutput, SchedulerOutput, WorkerInput
    from rollout.parallel.group_failures import GroupOutOfStep
    from tests.executors.fake_executor import Answer, Fails, Hangs, ScriptedExecutor

    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    config = EngineConfig(model=str(tmp_path), executor=ScriptedExecutor, num_workers=4, sequence_parallel=2)
    executor = ScriptedExecutor(config)
    executor.script("execute", Hangs(), ranks=[2])
    executor.script("execute", Fails(GroupOutOfStep("rank 1 of replica group 1 failed: OSError: device")), ranks=[3])
    with pytest.raises(
        EngineDeadError, match=r"worker rank 3 of replica group 1 failed a step: GroupOutOfStep.*device"
    ):
        executor.execute(SchedulerOutput({1: WorkerInput(step_ids=["a"])}))
    assert executor.log.stopped == 1 and executor.dead.startswith("worker rank 3 of replica group 1")

    executor = ScriptedExecutor(config)
    executor.script("execute", Answer(RunnerOutput(failed={"b": "RuntimeError: only here"})), ranks=[1])
    with pytest.raises(EngineDeadError, match=r"rank 1 of replica group 0 failed requests \['b'\] that its leader"):
        executor.execute(SchedulerOutput({0: WorkerInput(step_ids=["a", "b"])}))


def test_layouts_that_are_not_replicas_times_ranks_are_refused():
    with pytest.raises(ValueError, match=r"num_workers=3 is not replicas x ranks per replica.*multiple of 2"):
        EngineConfig(model="x", executor="mp", num_workers=3, sequence_parallel=2)
    with pytest.raises(ValueError, match="sequence_parallel must be an integer >= 1"):
        EngineConfig(model="x", sequence_parallel=0)
    config = EngineConfig(model="x", executor="mp", num_workers=6, sequence_parallel=3)
    assert (config.num_replicas, config.ranks_per_replica) == (2, 3)
    layout = ReplicaLayout.of(config)
    assert [list(layout.ranks_of(g)) for g in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [layout.replica_of(rank) for rank in range(6)] == [0, 0, 0, 1, 1, 1]


def test_a_family_without_a_context_parallel_plan_is_refused_before_any_worker_starts(tiny_models):
    config = EngineConfig(model=tiny_models("sd3"), executor="mp", num_workers=2, sequence_parallel=2)
    with pytest.raises(ValueError, match=r"transformer \(SD3Transformer2DModel\) has none.*sequence_parallel=1"):
        RolloutEngine(config)


def test_uni_cannot_run_a_group(tiny_models):
    with pytest.raises(ValueError, match="executor 'uni' runs one in-process worker"):
        RolloutEngine(EngineConfig(model=tiny_models("flux"), num_workers=2, sequence_parallel=2))


@pytest.mark.slow  # two processes, killed
def test_killing_one_rank_of_a_group_fails_the_engine_fast(tiny_models):
    config = EngineConfig(model=tiny_models("flux"), executor="mp", num_workers=2, sequence_parallel=2)
    engine = RolloutEngine(config)
    pids = engine.collective_rpc(worker_pid)
    engine.collective_rpc(slow_down_steps, args=(0.2,))
    killer = threading.Timer(1.0, os.kill, args=(pids[1], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    params = FAMILIES["flux"].params(num_inference_steps=200, num_samples=2, seed=0)
    with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) died"):
        engine.generate("x", params)
    assert time.monotonic() - start < 1.0 + 5.0
    assert wait_gone(pids) == []
    engine.shutdown()
    killer.join()


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("where", ["before the forward", "inside the forward"])
def test_a_step_that_fails_on_one_rank_only_fails_the_engine_fast(tiny_models, where):
    """Rank 0 waits in an all-to-all (or the output gather) that rank 1 never joins; without the
    group's failure reports it would wait out the step timeout (120 s here)."""
    config = EngineConfig(
        model=tiny_models("flux"), executor="mp", num_workers=2, sequence_parallel=2, step_timeout_s=120
    )
    engine = RolloutEngine(config)
    pids = engine.collective_rpc(worker_pid)
    params = FAMILIES["flux"].params(num_inference_steps=2, num_samples=2, seed=0)
    start = time.monotonic()
    engine.generate("x", params)
    baseline = time.monotonic() - start  # a whole rollout of the same size, both ranks well
    if where == "before the forward":
        engine.collective_rpc(fail_requests_of, args=("x",), ranks=[1])
        original = "RuntimeError: injected step failure for 'x'"
    else:
        engine.collective_rpc(fail_inside_the_forward, ranks=[1])
        original = "RuntimeError: injected failure inside the forward on rank 1"
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank 1 of replica group 0 failed a step") as raised:
        engine.generate("x", params)
    assert time.monotonic() - start < baseline + FAILURE_GRACE_S + 5.0
    assert original in str(raised.value)
    assert wait_gone(pids) == []  # the rank left waiting in the collective is stopped too
    with pytest.raises(EngineDeadError, match="worker rank 1 of replica group 0"):
        engine.generate("x", params)
    engine.shutdown()


def test_the_server_and_the_recipes_take_the_layout():
    from recipes.config import EngineSection
    from rollout.serve.__main__ import engine_flag_names, parse_args
    from rollout.serve.setting_flags import settings_from_args

    args = parse_args(["--model", "m", "--executor", "mp", "--num-workers", "4", "--sequence-parallel", "2"])
    config = EngineConfig(**settings_from_args(args, engine_flag_names()))
    assert (config.num_replicas, config.ranks_per_replica) == (2, 2)
    with pytest.raises(ValueError, match="num_workers=3 is not replicas x ranks per replica"):
        EngineSection(executor="mp", num_workers=3, sequence_parallel=2)


@pytest.mark.slow  # a Ray cluster and two actors in a gloo group
def test_a_group_of_two_ray_actors_equals_one_worker(ray_cluster, tiny_models, reference):
    config = EngineConfig(model=tiny_models("flux"), executor="ray", num_workers=2, sequence_parallel=2)
    with RolloutEngine(config) as engine:
        _assert_close(_run(engine, FAMILIES["flux"], True), reference("flux", True))


@pytest.mark.slow  # a server process and its two worker processes
def test_a_server_with_sequence_parallel_serves_what_one_worker_samples(tiny_models):
    from rollout import RemoteRolloutEngine
    from rollout.serve.launch import ServerProcess

    model = tiny_models("flux")
    params = FAMILIES["flux"].params(cfg=True, num_inference_steps=3, num_samples=2, seed=4, sde_window=(0, 2))
    with RolloutEngine(EngineConfig(model=model)) as engine:
        want = engine.generate(PROMPTS, params)
    flags = ("--executor", "mp", "--num-workers", "2", "--sequence-parallel", "2")
    with (
        ServerProcess.start(model, *flags, api_key="sp-test-key-0123456789", timeout_s=280) as server,
        RemoteRolloutEngine(server.url, api_key="sp-test-key-0123456789") as remote,
    ):
        got = remote.generate(PROMPTS, params)
        assert isinstance(remote.weights_checksum(), str)  # every rank holds the same weights
    for g, w in zip(got, want, strict=True):
        assert (g.trajectory.latents.stack() - w.trajectory.latents.stack()).abs().max() < TOLERANCE
        assert (g.trajectory.log_probs - w.trajectory.log_probs).abs().max() < TOLERANCE
