"""The ray backend's promises: lazy import with an install hint, prompt failure on actor death."""

from __future__ import annotations

import subprocess
import sys
import time

import cloudpickle
import pytest

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.errors import EngineDeadError
from tests.executors import worker_functions
from tests.executors.worker_functions import (
    kill_rank_1_of_a_slowed_engine,
    sleep_in_worker,
    wait_gone,
    worker_pid,
)

cloudpickle.register_pickle_by_value(worker_functions)

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow  # a fresh interpreter importing every package
def test_importing_the_project_never_imports_ray():
    code = "import sys, rollout, executors, trainers_adapters, recipes.run; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_selecting_ray_without_ray_installed_says_how_to_install(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray looks like
    with pytest.raises(ImportError, match=r"executor 'ray' needs Ray: pip install 'diffusion-rollout\[ray\]'"):
        RolloutEngine(EngineConfig(model=tiny_model, executor="ray"))


@pytest.mark.slow  # a Ray cluster's start-up alone takes seconds; the scripted transport holds the policy
@pytest.mark.parametrize("during", ["rollout", "rpc"])
def test_killing_an_actor_fails_fast(ray_cluster, tiny_model, during):
    engine = RolloutEngine(EngineConfig(model=tiny_model, executor="ray", num_workers=2))
    pids, live_rpc_s = kill_rank_1_of_a_slowed_engine(engine)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1 \\(Ray actor\\) died"):
        if during == "rollout":
            engine.generate("x", SamplingParams(num_inference_steps=200, num_samples=4, seed=0))
        else:
            engine.collective_rpc(sleep_in_worker, args=(60,))
    assert time.monotonic() - start < 1.0 + 5.0
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        engine.collective_rpc("get_rank")
    assert time.monotonic() - start < 2 * live_rpc_s + 0.05  # refused here, without reaching a worker
    assert wait_gone(pids) == []
    engine.shutdown()


@pytest.mark.slow  # repetition for the default suite: CI runs it (make test-slow)
def test_shutdown_removes_the_actors(ray_cluster, tiny_model):
    engine = RolloutEngine(EngineConfig(model=tiny_model, executor="ray", num_workers=2))
    pids = engine.collective_rpc(worker_pid)
    engine.shutdown()
    assert wait_gone(pids) == []
    assert ray_cluster.available_resources().get("CPU") == ray_cluster.cluster_resources()["CPU"]


@pytest.mark.slow  # a Ray cluster's start-up alone takes seconds
def test_a_workers_progress_is_read_while_it_runs_a_call(ray_cluster, tiny_model):
    # The read has a concurrency group of its own: it answers while a call runs, not after it.
    with RolloutEngine(EngineConfig(model=tiny_model, executor="ray", num_workers=1)) as engine:
        executor = engine.executor
        before = dict(executor._progress([0]))
        engine.generate("x", SamplingParams(num_inference_steps=2, seed=0))
        pending = executor._send_rpc("sleep_in_worker", sleep_in_worker, (3.0,), {}, [0])
        start = time.monotonic()
        during = dict(executor._progress([0]))
        assert time.monotonic() - start < 1.5
        assert during[0] > before[0]  # the generate's blocks
        assert executor._gather("sleep_in_worker", pending, 10.0) == {0: None}
