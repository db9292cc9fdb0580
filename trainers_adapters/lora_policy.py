"""The trainer's own trainable copy of the policy: the pipeline adapter with a PEFT LoRA on its
transformer. It re-scores rollouts with gradients through the same `predict_velocity` and sampler
functions the engine sampled with, and hands its LoRA tensors to `engine.load_lora`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout.outputs import Trajectory
from rollout.pipelines.condition import Condition
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import score_transitions
from rollout.samplers import StepOutput


class LoraPolicy:
    """A frozen base model plus one trainable LoRA adapter named `name`."""

    def __init__(self, model: str, lora_config: LoraConfig | Mapping, name: str = "policy", device: str = "cpu"):
        self.adapter = load_adapter(model, device)
        self.name = name
        self.lora_config = lora_config if isinstance(lora_config, LoraConfig) else LoraConfig(**lora_config)
        transformer = self.adapter.transformer
        transformer.requires_grad_(False)
        transformer.add_adapter(self.lora_config, adapter_name=name)
        transformer.set_adapters([name])

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trainable LoRA parameters (what the optimizer updates)."""
        return [p for p in self.adapter.transformer.parameters() if p.requires_grad]

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors in PEFT keys, detached copies: what `engine.load_lora` takes."""
        state = get_peft_model_state_dict(self.adapter.transformer, adapter_name=self.name)
        return {key: tensor.detach().clone() for key, tensor in state.items()}

    def push(self, engine) -> int:
        """Hot-swap this adapter into the engine under its name; returns the new weight version."""
        return engine.load_lora(self.name, self.lora_state(), self.lora_config)

    def score(self, trajectories: list[Trajectory], step: int, reference: bool = False) -> StepOutput:
        """Re-score step `step` of each trajectory (one batched forward) with gradients through the
        LoRA; with `reference`, under the base model (LoRA disabled) and without gradients.

        The trajectories must share sampler, noise level and guidance (one rollout call's do)."""
        first = trajectories[0]
        transformer = self.adapter.transformer
        latents = torch.stack([t.latents[step] for t in trajectories])
        next_latents = torch.stack([t.latents[step + 1] for t in trajectories])
        sigmas = torch.stack([t.sigmas[step] for t in trajectories])
        sigmas_next = torch.stack([t.sigmas[step + 1] for t in trajectories])
        condition = Condition.stack([t.condition for t in trajectories])
        args = (latents, next_latents, sigmas, sigmas_next, condition, first.guidance_scale, first.sampler)
        if not reference:
            return score_transitions(self.adapter, *args, first.noise_level)
        transformer.disable_lora()
        try:
            with torch.no_grad():
                return score_transitions(self.adapter, *args, first.noise_level)
        finally:
            transformer.enable_lora()
