"""The update rules: densities against independent formulas, re-scoring, and step masks."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.samplers import SAMPLERS, get_sampler, is_stochastic_step
from rollout.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)


def _inputs(batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, 8, 8, generator=g)
    v = torch.randn(batch, 4, 8, 8, generator=g)
    noise = torch.randn(batch, 4, 8, 8, generator=g)
    return x, v, noise


def test_flow_sde_log_prob_is_the_gaussian_density_of_the_flow_grpo_step():
    x, v, noise = _inputs()
    sigma = torch.tensor([0.9, 0.5, 0.2])
    sigma_next = torch.tensor([0.7, 0.3, 0.0])
    a = 0.7
    out = get_sampler("flow_sde")(x, v, sigma, sigma_next, a, noise=noise)

    # Independent computation in float64 from the published formulas.
    x64, v64 = x.double(), v.double()
    s, sn = sigma.double().view(-1, 1, 1, 1), sigma_next.double().view(-1, 1, 1, 1)
    dt = sn - s
    std_t = a * torch.sqrt(s / (1 - s))
    mean = x64 * (1 + std_t**2 / (2 * s) * dt) + v64 * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    std = std_t * torch.sqrt(-dt)
    expected_sample = mean + std * noise.double()
    density = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(expected_sample)
    expected = density.mean(dim=(1, 2, 3))

    torch.testing.assert_close(out.prev_sample.double(), expected_sample, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.log_prob.double(), expected, atol=1e-4, rtol=1e-5)
    assert out.prev_sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32


def test_flow_sde_at_sigma_one_uses_the_next_sigma_in_the_denominator():
    x, v, noise = _inputs(batch=1)
    out = get_sampler("flow_sde")(x, v, 1.0, 0.8, 0.5, noise=noise)
    expected_std = 0.5 * math.sqrt(1 / (1 - 0.8)) * math.sqrt(0.2)
    assert out.std.item() == pytest.approx(expected_std, rel=1e-6)
    assert torch.isfinite(out.log_prob).all()


@pytest.mark.parametrize("name", ["flow_sde", "cps", "dance_sde"])
def test_rescoring_the_sampled_transition_gives_the_same_log_prob(name):
    x, v, noise = _inputs()
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1])
    sampled = get_sampler(name)(x, v, sigma, sigma_next, 0.6, noise=noise)
    rescored = get_sampler(name)(x, v, sigma, sigma_next, 0.6, prev_sample=sampled.prev_sample)
    assert torch.equal(rescored.prev_sample, sampled.prev_sample)
    assert (rescored.log_prob - sampled.log_prob).abs().max() < 1e-5
    # A different velocity is a different policy: the density of the same sample changes.
    other = get_sampler(name)(x, v + 0.5, sigma, sigma_next, 0.6, prev_sample=sampled.prev_sample)
    assert (other.log_prob - sampled.log_prob).abs().min() > 1e-3


@pytest.mark.parametrize("name", ["cps", "dance_sde"])
def test_sampler_log_prob_matches_its_own_mean_and_std(name):
    x, v, noise = _inputs()
    sigma, sigma_next = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1])
    out = get_sampler(name)(x, v, sigma, sigma_next, 0.5, noise=noise)
    density = torch.distributions.Normal(out.mean.double(), out.std.double().expand_as(out.mean))
    expected = density.log_prob(out.prev_sample.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), expected, atol=1e-4, rtol=1e-5)


def test_cps_mean_and_std_follow_the_coefficient_preserving_formula():
    x, v, noise = _inputs(batch=1)
    sigma, sigma_next, a = 0.6, 0.4, 0.5
    out = get_sampler("cps")(x, v, sigma, sigma_next, a, noise=noise)
    std = sigma_next * math.sin(a * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * x1
    torch.testing.assert_close(out.mean, mean, atol=1e-6, rtol=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-6)


def test_dance_sde_std_is_eta_sqrt_dsigma():
    x, v, noise = _inputs(batch=1)
    out = get_sampler("dance_sde")(x, v, 0.7, 0.5, 0.3, noise=noise)
    assert out.std.item() == pytest.approx(0.3 * math.sqrt(0.2), rel=1e-6)


def test_ode_is_the_euler_step_and_has_no_log_prob():
    x, v, noise = _inputs()
    out = get_sampler("ode")(x, v, 0.8, 0.6, 0.7, noise=noise)
    torch.testing.assert_close(out.prev_sample, x + v * (0.6 - 0.8))
    assert out.log_prob is None


def test_stochastic_steps_and_sde_window():
    assert [is_stochastic_step("cps", i, 4) for i in range(4)] == [True, True, True, False]
    assert all(is_stochastic_step("flow_sde", i, 4) for i in range(4))
    assert not any(is_stochastic_step("ode", i, 4) for i in range(4))
    params = SamplingParams(num_inference_steps=6, sde_window=(1, 4))
    assert params.sde_mask() == [False, True, True, True, False, False]
    assert SamplingParams(num_inference_steps=3, sampler="cps").sde_mask() == [True, True, False]


def test_unknown_sampler_names_the_choices():
    with pytest.raises(ValueError, match="unknown sampler 'euler'.*flow_sde"):
        get_sampler("euler")
    assert set(SAMPLERS) == {"ode", "flow_sde", "cps", "dance_sde"}
