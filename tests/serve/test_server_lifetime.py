"""Stopping a server (SIGTERM, as a process manager does) while requests run: those that finish
within `--shutdown-grace-s` are delivered, the rest end at once with an error naming the shutdown
instead of hanging, and no worker process or shared memory block outlives the server. A server
started again where one was is never mistaken for it."""

from __future__ import annotations

import glob
import signal
import time

import pytest

from rollout import RemoteRolloutEngine, SamplingParams
from rollout.errors import EngineDeadError
from rollout.serve.launch import ServerProcess
from tests.executors.worker_functions import wait_gone
from tests.serve.conftest import API_KEY, EXTENSION_FLAGS
from trainers_adapters.policy.lora_policy import LoraPolicy

STEP_DELAY_S = 0.5


@pytest.mark.timeout(180)
@pytest.mark.slow  # repetition for the default suite: CI runs it (make test-slow)
def test_sigterm_finishes_what_fits_in_the_grace_and_ends_the_rest(tiny_model):
    flags = ("--executor", "mp", "--num-workers", "2", *EXTENSION_FLAGS, "--shutdown-grace-s", "6")
    with ServerProcess.start(tiny_model, *flags, api_key=API_KEY) as server:
        with RemoteRolloutEngine(server.url, api_key=API_KEY) as remote:
            pids = remote.collective_rpc("pid")
            remote.collective_rpc("set_step_delay", args=(STEP_DELAY_S,))
            # The long one first, then wait until no request waits: each is admitted (a worker's step
            # holds it) and stays so until it ends. Waiting for two running requests, which a client sees
            # only between two steps, was unsound: where the second POST took over a second (a loaded
            # machine; reproduced with a 1.3 s sleep between the two), the short request had finished
            # before the long one was admitted, the wait ran out its 30 s, and the long request finished
            # before the SIGTERM, so both were delivered.
            (long,) = remote.add_request("long", SamplingParams(num_inference_steps=50, seed=0))  # ~25 s
            (short,) = remote.add_request("short", SamplingParams(num_inference_steps=3, seed=0))  # ~1.5 s
            deadline = time.monotonic() + 10
            while (info := remote.server_info())["running_requests"] < info["unfinished_requests"]:
                assert time.monotonic() < deadline, f"the requests were not admitted within 10 s: {info}"
                time.sleep(0.05)
            stopping = time.monotonic()
            # uvicorn re-raises the signal once it has shut down, so the exit status names SIGTERM.
            assert server.stop() == -signal.SIGTERM
            assert time.monotonic() - stopping < 6 + 10  # the grace, then the workers' stop: not the 25 s left
            delivered = remote.step()
            assert [output.request_id for output in delivered] == [short]
            assert delivered[0].status == "finished"
            with pytest.raises(EngineDeadError, match="the rollout server is shutting down"):
                remote.step()
            assert not remote.has_unfinished_requests()
    assert wait_gone(pids) == []
    assert glob.glob(f"/dev/shm/rollout-{server.process.pid}-*") == []


@pytest.mark.timeout(120)
@pytest.mark.slow  # a server of its own (about 11 s); the default suite keeps mp's killed-worker test
def test_a_killed_server_fails_every_call_at_once_with_engine_dead(tiny_model):
    with ServerProcess.start(tiny_model, *EXTENSION_FLAGS, api_key=API_KEY) as server:
        with RemoteRolloutEngine(server.url, api_key=API_KEY) as remote:
            remote.collective_rpc("set_step_delay", args=(STEP_DELAY_S,))
            remote.add_request("long", SamplingParams(num_inference_steps=50, seed=0))
            server.process.kill()  # no shutdown of any kind: an OOM kill, a lost node
            server.process.wait()
            killed = time.monotonic()
            with pytest.raises(EngineDeadError, match=f"lost the rollout server at {server.url}"):
                remote.step()
            with pytest.raises(EngineDeadError, match="is it running"):
                remote.generate("x", SamplingParams(num_inference_steps=2))
            assert time.monotonic() - killed < 5
    with pytest.raises(EngineDeadError, match="ConnectError"):
        RemoteRolloutEngine(server.url, api_key=API_KEY)  # nothing listens there any more


@pytest.mark.timeout(300)
@pytest.mark.slow  # two server starts; the instance checks on one server are in test_server_instance.py
def test_a_restarted_server_fails_the_client_until_it_reconnects(tiny_model):
    with ServerProcess.start(tiny_model, api_key=API_KEY) as first:
        remote = RemoteRolloutEngine(first.url, api_key=API_KEY)
        policy = LoraPolicy(tiny_model, {"r": 4, "lora_alpha": 8})
        assert policy.push(remote) == 1
    port = int(first.url.rpartition(":")[2])
    with ServerProcess.start(tiny_model, api_key=API_KEY, port=port) as second, remote:
        assert second.instance_id != first.instance_id
        restart = f"restarted.*instance {first.instance_id} → {second.instance_id}.*weight_version went from 1 to 0"
        with pytest.raises(EngineDeadError, match=restart):
            remote.generate("x", SamplingParams(num_inference_steps=1, lora="policy"))  # the streamed route
        with pytest.raises(EngineDeadError, match=restart):  # and every call after: it sends nothing
            remote.server_info()
        with pytest.raises(EngineDeadError, match=restart):
            policy.push(remote)
        assert remote.reconnect() == second.instance_id == remote.instance_id
        assert remote.weight_version == 0 and remote.list_loras() == []  # the push never reached it
        assert [output.status for output in remote.generate("x", SamplingParams(num_inference_steps=1))] == [
            "finished"
        ]
