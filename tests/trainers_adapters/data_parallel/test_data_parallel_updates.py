"""The data-parallel contract on the updates: two gloo ranks, each training on its share of a
step's groups (sampled by its own engine and gathered, or sampled by one engine and scattered),
give the LoRA and the statistics one rank gives over the whole step with the same seed."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import SamplingParams
from tests.trainers_adapters.data_parallel.rank_updates import LORA, full_updates, updates
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.old_policy import OldPolicy
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = ["a red square", "a blue circle", "a green star", "a red house", "a yellow boat"]


@pytest.fixture(scope="module")
def rollouts_file(engine, tiny_model, tmp_path_factory) -> str:
    """A GRPO rollout (SDE, the policy's fresh adapter) and a DiffusionNFT one (ODE, the old
    policy's), of five prompts: an odd count, so the two ranks' shares differ in size."""
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    old = OldPolicy(policy)
    policy.push(engine)
    old.push(engine)
    sde = SamplingParams(num_inference_steps=4, num_samples=3, seed=3, lora=policy.name, noise_level=0.7)
    ode = SamplingParams(
        num_inference_steps=3, num_samples=2, seed=4, lora=old.name, sampler="ode", guidance_scale=1.0
    )
    base = SamplingParams(num_inference_steps=4, num_samples=3, seed=5, noise_level=0.7)  # no adapter: full training
    with ThreadPoolExecutor(1) as pool:
        rollouts = {
            "grpo": generate_with_rewards(engine, PROMPTS, sde, colour_target, pool),
            "nft": generate_with_rewards(engine, PROMPTS, ode, colour_target, pool, "ode"),
            "base": generate_with_rewards(engine, PROMPTS, base, colour_target, pool, "base"),
        }
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.pt"
    torch.save(rollouts, path)
    engine.unload_lora(policy.name)
    engine.unload_lora(old.name)
    return str(path)


def test_two_ranks_train_as_one_rank_over_the_whole_step(tiny_model, rollouts_file, tmp_path):
    updates(0, 1, tiny_model, rollouts_file, str(tmp_path), None)
    context = multiprocessing.get_context("spawn")
    store = str(tmp_path / "store")
    ranks = [
        context.Process(target=updates, args=(rank, 2, tiny_model, rollouts_file, str(tmp_path), store))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=200)
    assert [process.exitcode for process in ranks] == [0, 0]
    one, two = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2.pt")
    torch.manual_seed(0)
    initial = LoraPolicy(tiny_model, LORA).lora_state()
    assert set(one) == set(two) == {"grpo_gathered", "grpo_scattered", "dpo", "nft"}
    for update, (lora, stats) in one.items():
        other_lora, other_stats = two[update]
        assert set(lora) == set(other_lora)
        moved = max(float((lora[key] - initial[key]).abs().max()) for key in initial)
        assert moved > 1e-3, f"{update}: the update did not move the LoRA"
        # Float32 sums in another order (a micro-batch of one rank's samples, the gradients' all-reduce)
        # differ in the last bits; AdamW at lr 1e-2 divides each gradient by its own size, so a
        # parameter whose gradient is near 0 moves by up to lr on such a difference. Measured: 2.0e-6.
        for key in lora:
            torch.testing.assert_close(other_lora[key], lora[key], rtol=0, atol=1e-5, msg=f"{update} {key}")
        # Statistics: the same sums; a log-prob re-scored in another micro-batch differs by an ULP
        # (measured 1.2e-7 of |log ratio|), and the policy loss is a mean near 0 (measured 1.2e-8 apart).
        for name, value in stats.items():
            assert other_stats[name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{update} {name}"


def _spawn(target, world_size: int, *args) -> None:
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=target, args=(rank, world_size, *args)) for rank in range(world_size)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=200)
    assert [process.exitcode for process in processes] == [0] * world_size


def test_two_fsdp_ranks_train_every_weight_as_one_rank(tiny_model, rollouts_file, tmp_path):
    """`FullPolicy` sharded over 2 ranks against 1 (FSDP2 on a one-rank group): the same weights and
    statistics after a GRPO and a DPO update, and the engine holds exactly them after the push: a
    `uni` engine on each rank, and rank 0's engine of two `mp` replicas."""
    _spawn(full_updates, 1, tiny_model, rollouts_file, str(tmp_path), str(tmp_path / "store1"))
    _spawn(full_updates, 2, tiny_model, rollouts_file, str(tmp_path), str(tmp_path / "store2"))
    one, two = torch.load(tmp_path / "full_world1.pt"), torch.load(tmp_path / "full_world2.pt")
    initial = dict(LoraPolicy(tiny_model, LORA).adapter.transformer.state_dict())
    assert one["mp_replicas"] == one["dpo"][4] and two["mp_replicas"] == two["dpo"][4]  # both replicas: DPO's
    for update in ("grpo", "dpo"):
        weights, stats, version, pushed, trained = one[update]
        other_weights, other_stats, other_version, other_pushed, other_trained = two[update]
        assert pushed == trained and other_pushed == other_trained, f"{update}: the engine holds other weights"
        assert version == other_version == 1
        moved = max(float((weights[k] - initial[k]).abs().max()) for k in weights if k in initial)
        assert moved > 1e-4, f"{update}: the update did not move the weights"
        # AdamW at lr 1e-3: a weight whose gradient is near 0 moves by up to lr on a float32 difference.
        for key in weights:
            torch.testing.assert_close(other_weights[key], weights[key], rtol=0, atol=1e-4, msg=f"{update} {key}")
        for name, value in stats.items():
            assert other_stats[name] == pytest.approx(value, rel=1e-4, abs=1e-6), f"{update} {name}"
