"""The update rules: densities against independent formulas, re-scoring, and step masks."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.rescoring import RATIO_TOLERANCE
from rollout.samplers import SAMPLERS, NoDensityError, get_sampler, is_stochastic_step
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
    assert (rescored.log_prob - sampled.log_prob).abs().max() < RATIO_TOLERANCE
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


# Log-prob forms, Flow-GRPO's std_dev_t, and steps without a density.


def test_cps_flow_grpo_form_is_minus_the_mean_squared_gap():
    x, v, noise = _inputs()
    sigma, sigma_next, a = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1]), 0.5
    gaussian = get_sampler("cps")(x, v, sigma, sigma_next, a, noise=noise)
    flow_grpo = get_sampler("cps")(x, v, sigma, sigma_next, a, noise=noise, log_prob_form="flow_grpo")
    assert torch.equal(flow_grpo.prev_sample, gaussian.prev_sample)
    # Flow-GRPO's CPS: -(x' - mean)^2 averaged over the latent, every constant dropped.
    gap = (flow_grpo.prev_sample.double() - flow_grpo.mean.double()) ** 2
    torch.testing.assert_close(flow_grpo.log_prob.double(), -gap.mean(dim=(1, 2, 3)), atol=1e-7, rtol=1e-6)
    # The relation between the forms: gaussian = flow_grpo / (2 s^2) - log s - log sqrt(2 pi).
    s = (sigma_next * math.sin(a * math.pi / 2)).double()
    related = flow_grpo.log_prob.double() / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(gaussian.log_prob.double(), related, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", ["flow_sde", "dance_sde"])
def test_flow_grpo_form_of_an_euler_maruyama_sde_is_its_gaussian_density(name):
    x, v, noise = _inputs()
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.0])
    gaussian = get_sampler(name)(x, v, sigma, sigma_next, 0.6, noise=noise)
    flow_grpo = get_sampler(name)(x, v, sigma, sigma_next, 0.6, noise=noise, log_prob_form="flow_grpo")
    assert torch.equal(flow_grpo.log_prob, gaussian.log_prob)


def test_std_dev_t_is_what_flow_grpo_s_step_function_returns():
    x, v, noise = _inputs()
    sigma, sigma_next, a = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1]), 0.6
    flow_sde = get_sampler("flow_sde")(x, v, sigma, sigma_next, a, noise=noise)
    # sqrt(sigma / (1 - sigma)) * a, with sigmas[1] in the denominator where sigma = 1: no sqrt(dt).
    expected = a * torch.sqrt(sigma / (1 - torch.tensor([0.8, 0.6, 0.3])))
    torch.testing.assert_close(flow_sde.std_dev_t.reshape(-1), expected)
    torch.testing.assert_close(flow_sde.std, flow_sde.std_dev_t * torch.sqrt(sigma - sigma_next).view(-1, 1, 1, 1))
    cps = get_sampler("cps")(x, v, sigma, sigma_next, a, noise=noise)
    torch.testing.assert_close(cps.std_dev_t.reshape(-1), sigma_next * math.sin(a * math.pi / 2))
    assert torch.equal(cps.std_dev_t, cps.std)
    dance = get_sampler("dance_sde")(x, v, sigma, sigma_next, 0.3, noise=noise)
    torch.testing.assert_close(dance.std_dev_t.reshape(-1), torch.full((3,), 0.3))


def test_cps_at_sigma_next_zero_gives_the_ode_result_and_no_nan():
    x, v, noise = _inputs()
    sigma, sigma_next = torch.tensor([0.3, 0.1, 0.05]), torch.tensor([0.1, 0.0, 0.0])
    for form in ("gaussian", "flow_grpo"):
        out = get_sampler("cps")(x, v, sigma, sigma_next, 0.7, noise=noise, log_prob_form=form)
        ode = get_sampler("ode")(x[1:], v[1:], sigma[1:], sigma_next[1:])
        assert torch.equal(out.prev_sample[1:], ode.prev_sample)
        assert torch.isfinite(out.log_prob).all() and out.log_prob[1:].eq(0).all()
        assert out.log_prob[0] != 0  # the row with a density keeps it
        with pytest.raises(NoDensityError, match=r"2 of the 3 transitions.*rows \[1, 2\].*scorable_steps"):
            get_sampler("cps")(x, v, sigma, sigma_next, 0.7, prev_sample=out.prev_sample, log_prob_form=form)


@pytest.mark.parametrize("name", ["flow_sde", "cps", "dance_sde"])
def test_noise_level_zero_samples_the_mean_without_nan(name):
    x, v, noise = _inputs()
    out = get_sampler(name)(x, v, torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1]), 0.0, noise=noise)
    assert torch.equal(out.prev_sample, out.mean)
    assert torch.equal(out.log_prob, torch.zeros(3))
    with pytest.raises(NoDensityError):
        get_sampler(name)(x, v, 0.6, 0.4, 0.0, prev_sample=out.prev_sample)


def test_an_unknown_log_prob_form_is_refused():
    x, v, noise = _inputs(batch=1)
    with pytest.raises(ValueError, match="log_prob_form must be one of"):
        get_sampler("cps")(x, v, 0.6, 0.4, 0.5, noise=noise, log_prob_form="constant_free")
    with pytest.raises(ValueError, match="log_prob_form must be one of"):
        SamplingParams(log_prob_form="exact")
