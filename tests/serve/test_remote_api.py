"""`RemoteRolloutEngine` mirrors `RolloutEngine`: a trainer swaps one for the other and changes nothing else."""

import inspect

import pytest

from rollout import RemoteRolloutEngine
from rollout.engine.rollout_engine import RolloutEngine

# What the async engine's loop drives the in-process engine with (a trainer never calls these),
# what watches this process's engine (a server's steps are the server's to observe), what a server
# asks before it decodes a client's images (a client's requests are checked there), and the parts
# of a push that the server receives over time (a remote trainer's update_weights streams into them).
LOOP_HOOKS = {"add_requests", "take_finished", "unfinished_request_ids", "dead", "add_step_observer", "check_requests"}
LOOP_HOOKS |= {"open_weight_push", "finish_weight_push", "abort_weight_push"}
LOOP_PARAMETERS = {"step": {"admit"}}


def _public_members(cls) -> dict:
    return {name: member for name, member in inspect.getmembers(cls) if not name.startswith("_")}


def _trainer_signature(name: str, member) -> inspect.Signature:
    signature = inspect.signature(member)
    hidden = LOOP_PARAMETERS.get(name, set())
    return signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in hidden])


@pytest.mark.timeout(30)
def test_every_public_method_has_the_same_signature_remotely():
    local, remote = _public_members(RolloutEngine), _public_members(RemoteRolloutEngine)
    missing = sorted(set(local) - set(remote) - LOOP_HOOKS)
    assert not missing, f"RemoteRolloutEngine lacks {missing}"
    for name, member in local.items():
        if name in LOOP_HOOKS or not callable(member):
            continue
        local_signature = _trainer_signature(name, member)
        remote_signature = inspect.signature(remote[name])
        assert remote_signature == local_signature, f"{name}: {remote_signature} != {local_signature}"

    # Attributes the engine sets itself are properties remotely, answered by the server.
    for name in ("weight_version", "sleep_level"):
        assert isinstance(getattr(RemoteRolloutEngine, name), property), name
