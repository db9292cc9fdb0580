"""Gradient checkpointing in the trainer's policy: the same log-probs and the same LoRA gradients as
without it, on every denoiser (both of Wan 2.2's experts), at a rollout's LoRA scale too, with
less kept for the backward."""

from __future__ import annotations

import pytest
import torch
from diffusers import PriorTransformer

from rollout import EngineConfig, RolloutEngine
from tests.families import ALL_FAMILIES
from trainers_adapters.policy.checkpointing import enable_gradient_checkpointing
from trainers_adapters.policy.lora_policy import LoraPolicy

pytestmark = pytest.mark.timeout(120)

CONFIG = {"r": 4, "lora_alpha": 8, "init_lora_weights": False}  # B != 0: gradients reach A as well as B
TOLERANCE = 1e-6  # relative, per LoRA tensor: |grad_ckpt - grad| / |grad|


def rollout(model: str, family: str, lora_scale: float | None) -> list:
    """Two prompts x 2 samples of flow_sde over 3 steps, sampled with the policy's adapter at
    `lora_scale` (None: the base model)."""
    config = {"lora": "policy", "lora_scale": lora_scale} if lora_scale is not None else {}
    params = ALL_FAMILIES[family].params(
        num_inference_steps=3, num_samples=2, seed=2, sampler="flow_sde", noise_level=0.7, **config
    )
    with RolloutEngine(EngineConfig(model=model)) as engine:
        if lora_scale is not None:
            torch.manual_seed(0)
            LoraPolicy(model, CONFIG).push(engine)
        return [o.trajectory for o in engine.generate(["a red square", "a blue circle"], params)]


def scored_gradients(model: str, trajectories: list, checkpointing: bool) -> tuple[torch.Tensor, dict, int]:
    """(log-probs, LoRA gradients by key, bytes autograd kept for the backward) of one re-score of
    the first and the last step (Wan 2.2: one on each expert) and its backward."""
    torch.manual_seed(0)  # the same LoRA init on both sides
    policy = LoraPolicy(model, CONFIG, gradient_checkpointing=checkpointing)
    assert all(d.is_gradient_checkpointing == checkpointing for d in policy.denoisers.values())
    last = len(trajectories[0].timesteps) - 1
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    # The outer hook sees what the forward keeps; a checkpointed block's own saves go to the
    # checkpoint's inner hooks (it keeps only the block's inputs) and are recomputed in the backward.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        scored = policy.score(trajectories, [0, last] * (len(trajectories) // 2))
    scored.log_prob.sum().backward()
    gradients = {key: p.grad.clone() for key, p in policy._lora_parameters().items()}
    return scored.log_prob.detach(), gradients, sum(saved)


@pytest.mark.parametrize(
    ("family", "lora_scale"),
    [("sd3", None), ("sd3", 0.5), ("flux", 0.5), ("wan22", 0.5)],  # 0.5: recomputed at the forward's scale
)
def test_checkpointed_gradients_are_the_plain_ones(tiny_models, family, lora_scale):
    model = tiny_models(family)
    trajectories = rollout(model, family, lora_scale)
    assert {t.lora_scale for t in trajectories} == {lora_scale}
    log_probs, gradients, kept = scored_gradients(model, trajectories, checkpointing=False)
    log_probs_ckpt, gradients_ckpt, kept_ckpt = scored_gradients(model, trajectories, checkpointing=True)

    assert torch.equal(log_probs_ckpt, log_probs)
    assert gradients_ckpt.keys() == gradients.keys()
    for key, gradient in gradients.items():  # a zero one (SD3's last block's context projections) stays zero
        error = (gradients_ckpt[key] - gradient).norm()
        assert error <= TOLERANCE * gradient.norm(), f"{key}: error {error:.2e} of {gradient.norm():.2e}"
    trained = {key.partition(".")[0] for key, gradient in gradients.items() if gradient.norm() > 0}
    assert trained >= ({"transformer_2", "blocks"} if family == "wan22" else {"transformer_blocks"})
    assert kept_ckpt < 0.7 * kept  # the blocks' activations are not kept for the backward


def test_a_denoiser_without_checkpointing_is_refused_by_name():
    model = PriorTransformer(num_attention_heads=1, attention_head_dim=4, num_layers=1, embedding_dim=4)
    with pytest.raises(ValueError, match=r"prior \(PriorTransformer\) of SomePipeline .* set trainer.gradient_checkp"):
        enable_gradient_checkpointing({"prior": model}, "SomePipeline")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_every_family_checkpoints_its_denoisers(tiny_models, family):
    policy = LoraPolicy(tiny_models(family), CONFIG, gradient_checkpointing=True)
    assert policy.denoisers and all(d.is_gradient_checkpointing for d in policy.denoisers.values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpointing_composes_with_compiled_blocks(tiny_model):
    """The checkpoint wraps each block's eager `__call__`; its compiled forward runs inside, in the
    forward and again in the backward: the same log-probs and gradients as compiled alone."""
    trajectories = rollout(tiny_model, "sd3", 0.5)
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        policy = LoraPolicy(tiny_model, CONFIG, compile="blocks", gradient_checkpointing=checkpointing)
        scored = policy.score(trajectories, 1)
        scored.log_prob.sum().backward()
        results[checkpointing] = scored.log_prob.detach(), [p.grad for p in policy.parameters()]
    (log_probs, gradients), (log_probs_ckpt, gradients_ckpt) = results[False], results[True]
    assert torch.equal(log_probs_ckpt, log_probs)
    for gradient, gradient_ckpt in zip(gradients, gradients_ckpt, strict=True):
        assert (gradient_ckpt - gradient).norm() <= TOLERANCE * gradient.norm()
