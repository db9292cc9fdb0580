"""Rewards computed per group on a background thread, overlapping with the rest of the rollout."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import EngineConfig, RolloutEngine, SamplingParams
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.checks import RewardError
from trainers_adapters.rewards.composite import CompositeReward, RewardComponent, groupwise
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards
from trainers_adapters.rewards.runner import RewardsOnThreads

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["a red square", "a green circle", "a blue star"]


@pytest.fixture(scope="module")
def small_batch_engine(tiny_model):
    """Batches of one group, so the groups finish one after another."""
    with RolloutEngine(EngineConfig(model=tiny_model, max_batch_size=2)) as engine:
        yield engine


def test_rewards_match_the_images_and_overlap_with_the_rollout(small_batch_engine):
    engine = small_batch_engine
    calls = []

    def reward(images, prompts, metadata):
        calls.append((threading.current_thread().name, engine.has_unfinished_requests(), list(prompts), metadata))
        return colour_target(images, prompts, metadata)

    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=1)
    with ThreadPoolExecutor(1, thread_name_prefix="reward") as pool:
        rollout = generate_with_rewards(engine, PROMPTS, params, reward, pool)

    assert [(o.prompt, o.sample_index) for o in rollout.outputs] == [(p, k) for p in PROMPTS for k in range(2)]
    assert rollout.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    images = torch.stack([o.image for o in rollout.outputs])
    expected = colour_target(images, [o.prompt for o in rollout.outputs], [{}] * 6)
    assert torch.equal(rollout.rewards, expected)
    assert [prompts for _, _, prompts, _ in calls] == [[p, p] for p in PROMPTS]  # one call per group
    assert all(name.startswith("reward") for name, _, _, _ in calls)
    assert calls[0][1], "the first group's reward ran while later groups were still denoising"
    second = rollout.outputs[1]
    metadata = {"prompt_index": 0, "sample_index": 1, "branch_path": (), "seed": second.seed, "weight_version": 0}
    metadata["input_images"] = None  # a text-only prompt (an edit's would be its input images)
    assert calls[0][3][1] == metadata
    assert rollout.rollout_s >= rollout.reward_wait_s >= 0


def test_a_failing_reward_leaves_no_request_behind(small_batch_engine):
    def broken(images, prompts, metadata):
        return torch.zeros(len(prompts) + 1)

    params = SamplingParams(num_inference_steps=2, num_samples=2, seed=1)
    message = r"reward 'broken' returned shape \(3,\) for 2 images \(prompt 0 sample 0, prompt 0 sample 1\)"
    with ThreadPoolExecutor(1) as pool, pytest.raises(RewardError, match=message):
        generate_with_rewards(small_batch_engine, PROMPTS, params, broken, pool)
    assert not small_batch_engine.has_unfinished_requests()


def test_an_interrupted_rollout_aborts_its_requests(small_batch_engine, monkeypatch):
    engine = small_batch_engine
    real_step = engine.step
    steps = []

    def step_then_fail():
        steps.append(1)
        if len(steps) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step_then_fail)
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=1)
    with ThreadPoolExecutor(1) as pool, pytest.raises(KeyboardInterrupt):
        generate_with_rewards(engine, PROMPTS, params, colour_target, pool)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    assert len(engine.generate(["a red square"], params)) == 2  # the engine still works


def test_images_are_required():
    with pytest.raises(ValueError, match="needs images"):
        generate_with_rewards(None, PROMPTS, SamplingParams(output_type="latent"), colour_target, None)


def test_a_groupwise_judge_gets_each_whole_group_of_a_tree_rollout_and_the_components_are_kept(small_batch_engine):
    """Batches of 2 leaves, so the groups' leaves finish over several engine steps; the judge still
    sees each prompt's 4 leaves together, in sample then branch order, once."""
    calls = []

    @groupwise
    def judge(images, prompts, metadata):
        calls.append([(m["prompt_index"], m["sample_index"], m["branch_path"]) for m in metadata])
        assert len(set(prompts)) == 1
        brightness = images.float().mean(dim=(1, 2, 3))
        return (brightness[:, None] > brightness[None, :]).float().mean(dim=1)

    reward = CompositeReward([RewardComponent("colour", colour_target, 1.0), RewardComponent("judge", judge, 0.5)])
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=1, branch_steps=(1,), branch_factor=2)
    with ThreadPoolExecutor(1) as pool:
        rollout = generate_with_rewards(small_batch_engine, PROMPTS, params, reward, pool)
    leaves = [(s, (b,)) for s in range(2) for b in range(2)]
    assert sorted(calls) == [[(p, s, path) for s, path in leaves] for p in range(3)]
    assert list(rollout.reward_components) == ["colour", "judge"]
    images = torch.stack([o.image for o in rollout.outputs])
    colour = colour_target(images, [o.prompt for o in rollout.outputs], [{}] * 12)
    torch.testing.assert_close(rollout.reward_components["colour"], colour, atol=0, rtol=0)
    torch.testing.assert_close(rollout.rewards, colour + 0.5 * rollout.reward_components["judge"], atol=1e-6, rtol=0)


def test_a_runner_scores_the_groups_itself_and_a_failed_group_stops_the_rollout_early(small_batch_engine, monkeypatch):
    engine = small_batch_engine
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=1)
    with RewardsOnThreads(colour_target) as runner:
        rollout = generate_with_rewards(engine, PROMPTS, params, runner)
        with pytest.raises(ValueError, match="not with a RewardRunner"), ThreadPoolExecutor(1) as pool:
            generate_with_rewards(engine, PROMPTS, params, runner, pool)
    images = torch.stack([o.image for o in rollout.outputs])
    assert torch.equal(rollout.rewards, colour_target(images, [o.prompt for o in rollout.outputs], [{}] * 6))

    def first_group_fails(images, prompts, metadata):
        raise RuntimeError("the scorer is down")

    real_step, steps = engine.step, []
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or real_step())
    with pytest.raises(RuntimeError, match="the scorer is down"):
        generate_with_rewards(engine, PROMPTS, params, first_group_fails)
    monkeypatch.undo()
    assert len(steps) < 3 * 3, "the rollout stopped before the last group's steps"  # 3 groups of 3 steps, one by one
    assert not engine.has_unfinished_requests()
