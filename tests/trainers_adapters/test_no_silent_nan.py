"""No NaN passes silently: scoring a step without a log-density raises at the scoring call, a
diverged adapter is refused by the engine, a NaN reward stops the rollout, and a non-finite loss or
gradient stops the update before the optimizer steps. Each case is the mistake as a user's own loop makes it."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import SamplingParams
from rollout.rescoring import recompute_log_probs, score_transitions
from rollout.samplers import NoDensityError
from trainers_adapters.grpo.loss import grpo_policy_loss
from trainers_adapters.grpo.trainer import GRPOSettings, grpo_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.optim import NonFiniteUpdateError, clip_and_step
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.checks import RewardError
from trainers_adapters.rewards.composite import CompositeReward, RewardComponent
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

pytestmark = pytest.mark.timeout(120)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": False}
PROMPTS = ["a red square", "a blue circle"]


def cps_params(**overrides) -> SamplingParams:
    fields = dict(num_inference_steps=4, num_samples=2, seed=7, sampler="cps", noise_level=0.7, lora="policy")
    return SamplingParams(**(fields | overrides))


def images(engine, params):
    return [output.image for output in engine.generate(PROMPTS, params)]


def test_a_flow_grpo_style_loop_over_every_transition_raises_at_scoring_and_changes_nothing(engine, tiny_model):
    """A loop that scores every transition of its CPS trajectories, as flow_grpo's does. CPS's last
    step has std 0: before, its log_prob came back NaN, one optimizer step made every LoRA parameter
    NaN, the push was accepted and the engine drew black images from then on."""
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    version = policy.push(engine)
    try:
        before = images(engine, cps_params())
        rollout = engine.generate(PROMPTS, cps_params())
        assert rollout[0].trajectory.scorable_steps.tolist() == [0, 1, 2]
        trajectories = [o.trajectory for o in rollout for _ in range(4)]
        steps = [step for _ in rollout for step in range(4)]
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5]).repeat_interleave(4)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        state = policy.lora_state()
        with pytest.raises(NoDensityError, match=r"step 3 of trajectory 3 .*scorable_steps, here \[0, 1, 2\]"):
            scored = policy.score(trajectories, steps)
            old = torch.stack([t.log_probs[step] for t, step in zip(trajectories, steps, strict=True)])
            loss, _ = grpo_policy_loss(scored.log_prob, old, advantages, 1e-4)
            loss.backward()
            optimizer.step()
            policy.push(engine)
        assert all(torch.equal(t, state[k]) for k, t in policy.lora_state().items())
        assert engine.weight_version == version and engine.list_loras() == ["policy"]
        assert all(torch.equal(a, b) for a, b in zip(before, images(engine, cps_params()), strict=True))
    finally:
        engine.unload_lora("policy")


def test_a_diverged_adapter_is_refused_and_the_served_one_stays(engine, tiny_model):
    torch.manual_seed(1)
    policy = LoraPolicy(tiny_model, LORA)
    version = policy.push(engine)
    try:
        before = images(engine, cps_params())
        with torch.no_grad():
            policy.parameters()[0].fill_(float("nan"))  # what one optimizer step on a NaN loss does
        with pytest.raises(ValueError, match="LoRA 'policy' refused: 1 of its tensors hold NaN"):
            policy.push(engine)
        assert engine.weight_version == version
        after = images(engine, cps_params())
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert all(image.float().mean() > 0 for image in after)
    finally:
        engine.unload_lora("policy")


def test_every_scoring_entry_point_refuses_a_step_without_density(engine, tiny_model, trainer_adapter):
    params = SamplingParams(num_inference_steps=5, sde_window=(1, 3), num_samples=1, seed=2, guidance_scale=1.0)
    (output,) = engine.generate(PROMPTS[0], params)
    trajectory = output.trajectory
    policy = LoraPolicy(tiny_model, LORA)
    with pytest.raises(NoDensityError, match=r"step 0 of trajectory 0 .*here \[1, 2\]"):
        policy.score([trajectory], 0)  # an ODE step outside the window: refused before any forward
    with pytest.raises(NoDensityError, match="step 7 of trajectory 0 is not a step"):
        policy.score([trajectory], 7)
    with pytest.raises(NoDensityError, match="sampler 'ode' has no log-density"):
        score_transitions(
            trainer_adapter,
            trajectory.latents[[0]],
            trajectory.latents[[1]],
            trajectory.sigmas[[0]],
            trajectory.sigmas[[1]],
            [trajectory.condition],
            "ode",
            0.7,
            height=trajectory.height,
            width=trajectory.width,
            guidance_scale=1.0,
        )
    # A trajectory whose mask claims CPS's last step (std 0) stops the batched re-score too.
    (cps,) = engine.generate(PROMPTS[0], cps_params(num_samples=1, lora=None, guidance_scale=1.0))
    cps.trajectory.sde_mask[-1] = True
    with pytest.raises(NoDensityError, match=r"1 of the 4 transitions to score have no log-density .*rows \[3\]"):
        recompute_log_probs(trainer_adapter, cps.trajectory)


def test_scoring_transitions_of_different_settings_in_one_batch_is_refused(engine, tiny_model):
    flow = engine.generate(PROMPTS[0], SamplingParams(num_inference_steps=3, seed=1, guidance_scale=1.0))
    wider = engine.generate(PROMPTS[0], SamplingParams(num_inference_steps=3, seed=1, noise_level=0.9))
    policy = LoraPolicy(tiny_model, LORA)
    with pytest.raises(ValueError, match=r"these differ: noise_level \(0.7 vs 0.9 in trajectory 1\)"):
        policy.score([flow[0].trajectory, wider[0].trajectory], 0)


def test_a_nan_reward_is_refused_at_the_rollout_naming_it_before_any_update(engine, tiny_model):
    """A judge that returns NaN for one image of a weighted sum: the rollout raises with the
    component's name and the sample, so the loop never reaches its update or push. A NaN that
    reaches the update anyway (rewards edited after the rollout) still stops the optimizer."""
    torch.manual_seed(2)
    policy = LoraPolicy(tiny_model, LORA)
    version = policy.push(engine)
    try:
        params = SamplingParams(num_inference_steps=3, num_samples=2, seed=3, lora="policy", guidance_scale=1.0)

        def judge(images, prompts, metadata):
            return torch.tensor([float("nan") if m["sample_index"] == 1 else 0.5 for m in metadata])

        reward = CompositeReward([RewardComponent("colour", colour_target), RewardComponent("judge", judge, 0.1)])
        state = policy.lora_state()
        message = r"reward 'judge' returned nan for 1 of 2 samples \(prompt 0 sample 1\); .* before any update"
        with ThreadPoolExecutor(1) as pool, pytest.raises(RewardError, match=message):
            rollout = generate_with_rewards(engine, PROMPTS, params, reward, pool)
            grpo_step(policy, torch.optim.AdamW(policy.parameters()), rollout, GRPOSettings(), torch.Generator())
            policy.push(engine)
        assert not engine.has_unfinished_requests() and engine.weight_version == version
        assert all(torch.equal(t, state[k]) for k, t in policy.lora_state().items())

        with ThreadPoolExecutor(1) as pool:
            rollout = generate_with_rewards(engine, PROMPTS, params, colour_target, pool)
        rollout = dataclasses.replace(rollout, rewards=torch.full_like(rollout.rewards, float("nan")))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        with pytest.raises(NonFiniteUpdateError, match="the loss of GRPO micro-batch .* is nan; the optimizer"):
            grpo_step(policy, optimizer, rollout, GRPOSettings(), torch.Generator().manual_seed(0))
        after = policy.lora_state()
        assert all(torch.equal(state[k], after[k]) for k in state)
        assert all(p.grad is None for p in policy.parameters())
    finally:
        engine.unload_lora("policy")


def test_an_infinite_gradient_stops_the_optimizer_step():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    (weight * torch.tensor([1.0, float("inf"), 1.0])).sum().backward()
    for max_grad_norm in (1.0, 0.0):  # clipping or not, the norm is checked
        with pytest.raises(NonFiniteUpdateError, match="the gradient norm is inf before the optimizer step"):
            clip_and_step([weight], optimizer, max_grad_norm)
        assert torch.equal(weight.detach(), torch.ones(3)) and weight.grad is None
        (weight * torch.tensor([1.0, float("inf"), 1.0])).sum().backward()
