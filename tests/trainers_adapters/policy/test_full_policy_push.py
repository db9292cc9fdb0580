"""A colocated full-parameter push: the engine in the trainer's process takes the gathered tensors
as its weights (no staging copy), none of them the trainer's own storage."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rollout import EngineConfig, RolloutEngine, SamplingParams
from rollout.weights.state import base_state, checksum
from trainers_adapters.data_parallel.trainer_ranks import TrainerRanks
from trainers_adapters.policy.full_policy import FullPolicy

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def one_rank():
    """A process group of one rank (FSDP needs one), ended after the test."""
    TrainerRanks.from_environment("cpu", always_join=True)
    yield
    dist.destroy_process_group()


def test_a_colocated_push_hands_the_gathered_tensors_to_the_engine(one_rank, tiny_model):
    torch.manual_seed(0)
    policy = FullPolicy(tiny_model)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.mul_(1.01)
    handed: dict[str, torch.Tensor] = {}
    gather = policy.full_state

    def recorded(component, masters=False, owned=False):
        for name, tensor in gather(component, masters, owned):
            handed[name] = tensor
            yield name, tensor

    policy.full_state = recorded
    with RolloutEngine(EngineConfig(model=tiny_model)) as engine:
        version = policy.push(engine)
        live = base_state(engine.executor.worker.adapter.transformer)
        assert handed.keys() == live.keys()
        assert all(live[name].data_ptr() == tensor.data_ptr() for name, tensor in handed.items())  # in place
        own = {p.to_local().untyped_storage().data_ptr() for p in policy.parameters()}
        assert not own & {tensor.untyped_storage().data_ptr() for tensor in handed.values()}
        assert engine.weights_checksum() == checksum(dict(gather("transformer")))
        # The trainer steps on; the engine's weights stay what was pushed, and sample at that version.
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.mul_(2.0)
        assert engine.weights_checksum() == checksum(handed)
        outputs = engine.generate(["a red square"], SamplingParams(num_inference_steps=2, num_samples=2, seed=1))
        assert all(output.weight_version == version for output in outputs)


def test_a_push_whose_gather_fails_midway_leaves_every_replica_on_the_old_version(one_rank, tiny_model):
    """A trainer rank that dies mid-push fails the others' gathers (gloo raises on the survivors):
    the engine drops what it staged, and both replicas keep the weights and version they had."""
    torch.manual_seed(0)
    policy = FullPolicy(tiny_model)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.mul_(1.01)
    gather = policy.full_state

    def failing(component, masters=False, owned=False):
        for index, pair in enumerate(gather(component, masters, owned)):
            if index == 5:
                raise ConnectionError("rank 1 is gone")
            yield pair

    with RolloutEngine(EngineConfig(model=tiny_model, executor="mp", num_workers=2)) as engine:
        before, version = engine.weights_checksum(), engine.weight_version
        policy.full_state = failing
        with pytest.raises(ConnectionError, match="rank 1 is gone"):
            policy.push(engine)
        assert engine.weights_checksum() == before and engine.weight_version == version  # every replica agrees
        policy.full_state = gather
        assert policy.push(engine) == version + 1
        assert engine.weights_checksum() == checksum(dict(gather("transformer")))
