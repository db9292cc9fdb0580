"""The three guidance fields travel as one `Guidance`: built once from a request or a trajectory,
the same velocity as the separate fields gave, and never both spellings at once."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from rollout.condition import Condition
from rollout.guidance import GUIDANCE_FIELDS, Guidance, guidance_argument
from rollout.model_spec import GUIDANCE_FIELDS as SPEC_GUIDANCE_FIELDS

pytestmark = pytest.mark.timeout(60)


def test_guidance_is_built_from_a_request_and_expanded_per_row():
    params = SamplingParams(guidance_scale=4.0, true_cfg_scale=None, guidance_scale_2=2.5)
    assert Guidance.of(params) == Guidance(guidance_scale=4.0, guidance_scale_2=2.5)
    rows = Guidance.per_row([params, SamplingParams(guidance_scale=1.0, guidance_scale_2=3.0)])
    assert rows.guidance_scale.tolist() == [4.0, 1.0] and rows.guidance_scale_2.tolist() == [2.5, 3.0]
    assert rows.true_cfg_scale is None
    expanded = Guidance(guidance_scale=2.0).expand(3, torch.device("cpu"))
    assert expanded.guidance_scale.tolist() == [2.0] * 3 and expanded.guidance_scale.dtype == torch.float32
    assert SPEC_GUIDANCE_FIELDS == GUIDANCE_FIELDS == ("guidance_scale", "guidance_scale_2", "true_cfg_scale")


def test_both_spellings_at_once_are_refused():
    assert guidance_argument(None, guidance_scale=3.0, true_cfg_scale=None) == Guidance(guidance_scale=3.0)
    with pytest.raises(TypeError, match="pass the guidance as guidance=Guidance.* or as guidance_scale, not both"):
        guidance_argument(Guidance(guidance_scale=3.0), guidance_scale=3.0)


def test_a_guidance_value_gives_the_velocity_the_separate_fields_gave(trainer_adapter):
    adapter = trainer_adapter
    embeds = adapter.encode_prompts(["a red square", ""], adapter.spec.default_max_sequence_length)
    conditions = [Condition(embeds[0], embeds[1]), Condition(embeds[0])]  # CFG on the first row only
    latents = torch.randn(2, *adapter.spec.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.9, 0.5])
    scales = torch.tensor([4.5, 1.0])
    with torch.no_grad():
        separate = adapter.predict_velocity(latents, sigmas, conditions, height=32, width=32, guidance_scale=scales)
        one = adapter.predict_velocity(
            latents, sigmas, conditions, height=32, width=32, guidance=Guidance(guidance_scale=scales)
        )
        unguided = adapter.predict_velocity(latents, sigmas, [conditions[1]] * 2, height=32, width=32)
    assert torch.equal(separate, one)
    assert not torch.allclose(one[0], unguided[0]) and torch.allclose(one[1], unguided[1], atol=1e-5)
