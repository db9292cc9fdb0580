"""Settings copied from a paper mean what its code computes: the KL forms, the CPS log-prob forms
and BranchGRPO's branch noise scale, each against the formula as the authors' code writes it
(written out here from sigmas and velocities, not through our sampler functions), on trajectories
from the engine."""

from __future__ import annotations

import math

import pytest
import torch

from rollout import SamplingParams
from rollout.rescoring import RATIO_TOLERANCE, recompute_log_probs
from trainers_adapters.grpo.loss import kl_to_reference
from trainers_adapters.policy.lora_policy import LoraPolicy

pytestmark = pytest.mark.timeout(120)

# A random (non-zero) adapter: the policy differs from the reference (the base), so the KL is not 0.
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": False}
PROMPTS = ["a red square", "a blue circle"]
STEPS = 6
NOISE = 0.7


@pytest.fixture(scope="module")
def policy(engine, tiny_model):
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    policy.push(engine)
    yield policy
    engine.unload_lora(policy.name)


def rollout(engine, policy, sampler, log_prob_form="gaussian", **params):
    params = SamplingParams(
        num_inference_steps=STEPS,
        num_samples=2,
        seed=5,
        sampler=sampler,
        noise_level=NOISE,
        log_prob_form=log_prob_form,
        guidance_scale=1.0,  # one conditional pass: the velocity below needs no CFG
        lora=policy.name,
        **params,
    )
    return [output.trajectory for output in engine.generate(PROMPTS, params)]


def velocity(policy, trajectories, step):
    """v at x_step of each trajectory, from the model (no sampler code involved)."""
    first = trajectories[0]
    return policy.adapter.predict_velocity(
        torch.stack([t.latents[step] for t in trajectories]),
        torch.stack([t.sigmas[step] for t in trajectories]),
        [t.condition for t in trajectories],
        height=first.height,
        width=first.width,
        guidance_scale=torch.full((len(trajectories),), 1.0),
    )


def flow_grpo_sde_mean(x, v, sigma, sigma_next, sigma_max, a):
    """Flow-GRPO's `sde_step_with_logprob` ('sde'): prev_sample_mean and std_dev_t, as written there."""
    dt = sigma_next - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * a
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t


def flow_grpo_cps_mean(x, v, sigma, sigma_next, a):
    """Flow-GRPO's `sde_step_with_logprob` ('cps'): prev_sample_mean and std_dev_t."""
    std_dev_t = sigma_next * math.sin(a * math.pi / 2)
    x0, x1 = x - sigma * v, x + v * (1 - sigma)
    return x0 * (1 - sigma_next) + x1 * math.sqrt(sigma_next**2 - std_dev_t**2), std_dev_t


@torch.no_grad()
def test_kl_forms_equal_flow_grpo_s_training_code_and_the_exact_kl(engine, policy):
    trajectories = rollout(engine, policy, "flow_sde")
    sigmas = trajectories[0].sigmas.tolist()
    ratios = []
    for step in range(STEPS):
        scored = policy.score(trajectories, step)
        with policy.reference():
            reference = policy.score(trajectories, step)
            v_ref = velocity(policy, trajectories, step)
        v = velocity(policy, trajectories, step)
        x = torch.stack([t.latents[step] for t in trajectories])
        sigma, sigma_next = sigmas[step], sigmas[step + 1]
        mean, std_dev_t = flow_grpo_sde_mean(x, v, sigma, sigma_next, sigmas[1], NOISE)
        mean_ref, _ = flow_grpo_sde_mean(x, v_ref, sigma, sigma_next, sigmas[1], NOISE)
        # Flow-GRPO: ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dims) / (2 * std_dev_t ** 2).
        expected_flow_grpo = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)
        # The exact KL of N(mean, s^2) and N(mean_ref, s^2) per element, s the transition std.
        expected_gaussian = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2 * (sigma - sigma_next))
        flow_grpo = kl_to_reference(scored, reference.mean, "flow_grpo")
        gaussian = kl_to_reference(scored, reference.mean, "gaussian")
        assert flow_grpo.min() > 0
        torch.testing.assert_close(flow_grpo, expected_flow_grpo, rtol=1e-4, atol=0)
        torch.testing.assert_close(gaussian, expected_gaussian, rtol=1e-4, atol=0)
        ratios.append((flow_grpo / gaussian).mean().item())
    # The forms differ by |dt| at each step.
    assert ratios == pytest.approx([sigmas[i] - sigmas[i + 1] for i in range(STEPS)], rel=1e-5)


@torch.no_grad()
def test_under_cps_both_kl_forms_divide_by_the_transition_std(engine, policy):
    trajectories = rollout(engine, policy, "cps")
    sigmas = trajectories[0].sigmas.tolist()
    for step in trajectories[0].scorable_steps.tolist():
        scored = policy.score(trajectories, step)
        with policy.reference():
            reference = policy.score(trajectories, step)
            v_ref = velocity(policy, trajectories, step)
        x = torch.stack([t.latents[step] for t in trajectories])
        mean, std_dev_t = flow_grpo_cps_mean(x, velocity(policy, trajectories, step), *sigmas[step : step + 2], NOISE)
        mean_ref, _ = flow_grpo_cps_mean(x, v_ref, *sigmas[step : step + 2], NOISE)
        expected = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)
        for form in ("flow_grpo", "gaussian"):
            torch.testing.assert_close(kl_to_reference(scored, reference.mean, form), expected, rtol=1e-4, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("form", ["gaussian", "flow_grpo"])
def test_cps_log_probs_are_stored_in_the_chosen_form_and_rescore_at_ratio_one(engine, policy, form):
    trajectories = rollout(engine, policy, "cps", log_prob_form=form)
    assert all(t.log_prob_form == form for t in trajectories)
    sigmas = trajectories[0].sigmas.tolist()
    for step in trajectories[0].scorable_steps.tolist():
        x = torch.stack([t.latents[step] for t in trajectories])
        x_next = torch.stack([t.latents[step + 1] for t in trajectories])
        mean, std = flow_grpo_cps_mean(x, velocity(policy, trajectories, step), *sigmas[step : step + 2], NOISE)
        gap = ((x_next - mean) ** 2).mean(dim=(1, 2, 3))
        if form == "flow_grpo":  # Flow-GRPO's CPS: log_prob = -((prev_sample - prev_sample_mean) ** 2), averaged
            expected = -gap
        else:
            expected = -gap / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
        stored = torch.stack([t.log_probs[step] for t in trajectories])
        torch.testing.assert_close(stored, expected, rtol=1e-4, atol=1e-6)
        # Sampling, re-scoring and the ratio use the one form.
        assert (policy.score(trajectories, step).log_prob - stored).abs().max() < RATIO_TOLERANCE
    for trajectory in trajectories:
        assert (recompute_log_probs(policy.adapter, trajectory) - trajectory.log_probs).abs().max() < RATIO_TOLERANCE


@torch.no_grad()
def test_flow_grpo_form_of_flow_sde_is_the_density_its_code_computes(engine, policy):
    by_form = {form: rollout(engine, policy, "flow_sde", log_prob_form=form) for form in ("gaussian", "flow_grpo")}
    for gaussian, flow_grpo in zip(*by_form.values(), strict=True):
        assert torch.equal(gaussian.log_probs, flow_grpo.log_probs)
        assert torch.equal(gaussian.latents[-1], flow_grpo.latents[-1])


def test_branch_children_are_drawn_at_the_scale_and_scored_with_the_step_std(engine, policy):
    """BranchGRPO's `flux_step_with_split`: a child is mean + (randn * split_noise_scale) * std_dev_t,
    and its log-prob is the Gaussian density with std_dev_t (unscaled). Same seeds at scale 1 and 4:
    the same draws, four times as far from the mean at the branch step, identical elsewhere."""
    branch = dict(branch_steps=(2,), branch_factor=2, record=("mean", "std"))
    plain = rollout(engine, policy, "flow_sde", **branch)
    wide = rollout(engine, policy, "flow_sde", branch_noise_scale=4.0, **branch)
    for one, four in zip(plain, wide, strict=True):
        for step in range(2):  # before the branch: bitwise the same
            assert torch.equal(one.latents[step + 1], four.latents[step + 1])
        eps_one = (one.latents[3] - one.records["mean"][2]) / one.records["std"][2]
        eps_four = (four.latents[3] - four.records["mean"][2]) / four.records["std"][2]
        torch.testing.assert_close(eps_four, 4 * eps_one, rtol=1e-4, atol=1e-4)
        assert torch.equal(one.records["std"][2], four.records["std"][2])  # scored with the step's std
        std = four.records["std"][2].double()
        gap = ((four.latents[3] - four.records["mean"][2]).double() ** 2).mean()
        expected = -gap / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        assert four.log_probs[2].item() == pytest.approx(expected.item(), rel=1e-5)
        # Re-scoring uses the same std: the ratio stays 1.
        assert (recompute_log_probs(policy.adapter, four) - four.log_probs).abs().max() < RATIO_TOLERANCE
    # Later steps draw at 1x again: the children's own step noise (x' - mean) / std keeps unit scale.
    later = torch.stack([(t.latents[5] - t.records["mean"][4]) / t.records["std"][4] for t in wide])
    assert 0.8 < later.std().item() < 1.2


def test_branch_noise_scale_needs_branch_steps_and_a_positive_finite_value():
    with pytest.raises(ValueError, match="branch_noise_scale 4.0 scales the noise of branch steps, but branch_steps"):
        SamplingParams(branch_noise_scale=4.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="branch_noise_scale must be a finite number > 0"):
            SamplingParams(branch_steps=(1,), branch_noise_scale=bad)
    assert SamplingParams(branch_steps=(1,), branch_noise_scale=4.0).branch_noise_scale == 4.0
