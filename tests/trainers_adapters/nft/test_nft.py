"""DiffusionNFT: the loss against a direct re-computation of the authors' formula, the old policy's
EMA (exactly the formula, nothing else moves), and the engine sampling with the old adapter."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rollout import SamplingParams
from trainers_adapters.nft.loss import implicit_velocities, nft_loss, optimality_probability
from trainers_adapters.nft.trainer import NFTSettings, nft_step
from trainers_adapters.policy.lora_policy import LoraPolicy
from trainers_adapters.policy.old_policy import DecaySchedule, OldPolicy, ema_update_
from trainers_adapters.rewards.builtin import colour_target
from trainers_adapters.rewards.rewarded_rollout import generate_with_rewards

pytestmark = pytest.mark.timeout(120)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


def papers_loss(v_theta, v_old, x_t, x0, t, advantages, beta, adv_clip_max):
    """The authors' train_nft_sd3.py lines, written out again: advantages -> r, the implicit
    policies, their x0 predictions, the adaptive weights, the weighted sum."""
    a = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    r = torch.clamp((a / adv_clip_max) / 2.0 + 0.5, 0, 1)
    t = t.view(-1, 1, 1, 1)
    positive = beta * v_theta + (1 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v_theta
    x0_pos = x_t - t * positive
    with torch.no_grad():
        w_pos = torch.abs(x0_pos.double() - x0.double()).mean(dim=(1, 2, 3), keepdim=True).clip(min=0.00001)
    loss_pos = ((x0_pos - x0) ** 2 / w_pos).mean(dim=(1, 2, 3))
    x0_neg = x_t - t * negative
    with torch.no_grad():
        w_neg = torch.abs(x0_neg.double() - x0.double()).mean(dim=(1, 2, 3), keepdim=True).clip(min=0.00001)
    loss_neg = ((x0_neg - x0) ** 2 / w_neg).mean(dim=(1, 2, 3))
    return ((r * loss_pos / beta + (1.0 - r) * loss_neg / beta) * adv_clip_max).mean()


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_the_loss_is_the_papers_formula(beta):
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(5, 4, 3, 3, generator=g), torch.randn(5, 4, 3, 3, generator=g)
    t = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.05])
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    v_old = noise - x0 + 0.1 * torch.randn(5, 4, 3, 3, generator=g)
    v_theta = (v_old + 0.05 * torch.randn(5, 4, 3, 3, generator=g)).requires_grad_()
    advantages = torch.tensor([-7.0, -1.0, 0.0, 2.5, 9.0])  # beyond the clip at both ends
    ours = nft_loss(v_theta, v_old, x_t, x0, t, optimality_probability(advantages, 5.0), beta, 5.0).mean()
    theirs = papers_loss(v_theta, v_old, x_t, x0, t, advantages, beta, 5.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    (grad_ours,) = torch.autograd.grad(ours, v_theta)
    (grad_theirs,) = torch.autograd.grad(theirs, v_theta)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-5, atol=1e-7)


def test_r_maps_advantages_linearly_and_the_implicit_policies_straddle_the_old_one():
    r = optimality_probability(torch.tensor([-9.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0]), 5.0)
    assert r.tolist() == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    v_theta, v_old = torch.tensor([3.0]), torch.tensor([1.0])
    positive, negative = implicit_velocities(v_theta, v_old, 0.1)
    assert positive.item() == pytest.approx(1.2) and negative.item() == pytest.approx(0.8)  # old +- beta (v - old)


def test_a_good_sample_pulls_the_policy_towards_it_and_a_bad_one_away():
    """At v = v_old the gradient in v is (2r - 1) times the x0 error's: r = 1 descends towards the
    sample (as flow matching would), r = 0 away from it, r = 1/2 not at all."""
    x0, x_t, t = torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1), torch.tensor([0.5])
    v_old = torch.zeros(1, 1, 1, 1)  # predicts x0 = x_t - t v = 1, the sample is at 0
    grads = []
    for r in (1.0, 0.0, 0.5):
        v = v_old.clone().requires_grad_()
        nft_loss(v, v_old, x_t, x0, t, torch.tensor([r]), 1.0, 5.0).sum().backward()
        grads.append(v.grad.item())
    assert grads[0] < 0 < grads[1]  # descending: r = 1 raises v (x0 prediction towards 0), r = 0 lowers it
    assert grads[0] == pytest.approx(-grads[1])  # 2r - 1 = +1 and -1
    assert grads[2] == pytest.approx(0.0, abs=1e-12)


def test_the_decay_schedules_are_the_authors():
    type_1, type_2 = DecaySchedule(0, 0.001, 0.5), DecaySchedule(75, 0.0075, 0.999)
    assert [type_1(s) for s in (0, 1, 250, 500, 10_000)] == [0.0, 0.001, 0.25, 0.5, 0.5]
    assert [type_2(s) for s in (0, 74, 75, 76)] == [0.0, 0.0, 0.0, 0.0075]
    assert type_2(175) == pytest.approx(0.75) and type_2(1000) == 0.999
    assert DecaySchedule(0, 0.0, 0.0)(123) == 0.0  # decay_type 0: the old policy is the current one


def test_the_ema_update_is_the_formula_and_refuses_mismatched_keys():
    g = torch.Generator().manual_seed(1)
    target = {"a": torch.randn(3, 2, generator=g), "b": torch.randn(4, generator=g)}
    expected = {key: tensor.clone() for key, tensor in target.items()}
    for decay in (0.0, 0.001, 0.3, 0.5):
        source = {key: torch.randn(t.shape, generator=g) for key, t in target.items()}
        kept = {key: t.clone() for key, t in source.items()}
        ema_update_(target, source, decay)
        expected = {key: expected[key] * decay + source[key] * (1.0 - decay) for key in expected}
        assert all(torch.equal(target[key], expected[key]) for key in target)
        assert all(torch.equal(source[key], kept[key]) for key in source)  # the source never moves
    before = {key: t.clone() for key, t in target.items()}
    with pytest.raises(ValueError, match="missing b"):
        ema_update_(target, {"a": torch.zeros(3, 2)}, 0.5)
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\]"):
        ema_update_(target, before, 1.5)
    assert all(torch.equal(target[key], before[key]) for key in target)


def test_the_old_adapter_changes_only_as_the_ema_says(tiny_model):
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    trainable = policy.parameters()
    old = OldPolicy(policy)
    assert [id(p) for p in policy.parameters()] == [id(p) for p in trainable]  # the optimizer never sees it
    assert all(torch.equal(old.tensors()[k], v) for k, v in policy_state(policy).items())  # a copy to start
    base = policy.weights_checksum()
    schedule = DecaySchedule(1, 0.2, 0.5)  # one flat step, then 0.2 per step, capped at 0.5
    expected = {key: tensor.clone() for key, tensor in old.tensors().items()}
    g = torch.Generator().manual_seed(2)
    decays = []
    for _ in range(4):
        with torch.no_grad():  # an optimizer step, as far as the old adapter can tell
            for p in trainable:
                p.add_(torch.randn(p.shape, generator=g))
        current = policy_state(policy)
        decays.append(old.step(1, schedule))
        expected = {key: expected[key] * decays[-1] + current[key] * (1.0 - decays[-1]) for key in expected}
        assert all(torch.equal(old.tensors()[key], expected[key]) for key in expected)
        assert all(torch.equal(policy_state(policy)[key], current[key]) for key in current)  # the policy stays
    assert decays == pytest.approx([0.0, 0.2, 0.4, 0.5]) and old.optimizer_steps == 4
    assert policy.weights_checksum() == base  # the base weights never move
    assert not any(p.requires_grad for p in old.tensors().values())
    with old.active():
        pass
    assert [id(p) for p in policy.parameters()] == [id(p) for p in trainable]  # switching back restores it


def policy_state(policy: LoraPolicy) -> dict[str, torch.Tensor]:
    """The policy's adapter under the old policy's keys, copied."""
    return {
        name.replace(f".{policy.name}.", "."): p.detach().clone()
        for name, p in policy.adapter.transformer.named_parameters()
        if f".{policy.name}." in name
    }


def euler(velocity, trajectory) -> torch.Tensor:
    """The final latents of the ODE from the trajectory's initial noise along its sigmas."""
    x = trajectory.latents[0].unsqueeze(0)
    for sigma, sigma_next in zip(trajectory.sigmas[:-1], trajectory.sigmas[1:], strict=True):
        x = x + velocity(x, sigma.reshape(1)) * (sigma_next - sigma)
    return x[0]


def test_the_engine_samples_with_the_old_adapter_and_nft_trains_only_on_its_samples(engine, tiny_model):
    torch.manual_seed(0)
    policy = LoraPolicy(tiny_model, LORA)
    old = OldPolicy(policy)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the old adapter and the policy's both differ from the base and from each other
        for p in policy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        old.step(1, DecaySchedule(0, 0.0, 0.0))  # decay 0: a copy
        for p in policy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    policy.push(engine)
    old.push(engine)
    params = SamplingParams(num_inference_steps=3, num_samples=2, seed=5, sampler="ode", guidance_scale=1.0)
    with ThreadPoolExecutor(1) as pool:
        sampled = dataclasses.replace(params, lora=old.name)
        rollout = generate_with_rewards(engine, ["a red square"], sampled, colour_target, pool)
        trajectory = rollout.trajectories[0]

        def velocity(x, sigma):
            return policy.predict_velocity(x, sigma, [trajectory])

        with old.active():
            sampled_by_old = euler(velocity, trajectory)
        with torch.no_grad():
            sampled_by_policy = euler(velocity, trajectory)
        final = trajectory.latents[-1]
        torch.testing.assert_close(final, sampled_by_old, rtol=0, atol=1e-5)
        assert (final - sampled_by_policy).abs().max() > 1e-2

        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        stats = nft_step(policy, old, optimizer, rollout, NFTSettings(), torch.Generator().manual_seed(0))
        assert stats.num_pairs == 2 * 2  # int(3 * 0.99) = 2 noise levels for each of the 2 samples
        assert stats.old_deviation > 0 and stats.grad_norm > 0 and stats.old_optimizer_steps == 2
        for wrong, message in [
            (dataclasses.replace(params, lora=policy.name), "not the old policy's 'old'"),
            (dataclasses.replace(params, lora=old.name, sampler="flow_sde", noise_level=0.7), "use sampler='ode'"),
            (dataclasses.replace(params, lora=old.name, guidance_scale=4.5), "set guidance_scale=1"),
        ]:
            other = generate_with_rewards(engine, ["a red square"], wrong, colour_target, pool)
            before = {key: t.clone() for key, t in old.tensors().items()}
            with pytest.raises(ValueError, match=message):
                nft_step(policy, old, optimizer, other, NFTSettings(), torch.Generator())
            assert all(torch.equal(old.tensors()[key], before[key]) for key in before)
    engine.unload_lora(policy.name)
    engine.unload_lora(old.name)
