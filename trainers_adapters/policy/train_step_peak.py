"""The activation peak of one training micro-batch: the bytes a forward and backward of the
denoiser through the trainer's LoRA policy add on top of the weights, measured by
`LiveTensorBytes` on real tensors, or estimated with no memory at all on `FakeTensorMode`'s
shape-only tensors over a model whose weights were never loaded (built on the meta device from its
configs: `recipes.memory_plan`).

The computation is the trainer's: `PipelineAdapter.predict_velocity` of `rows` transitions at the
request's size, frames and guidance (the unconditional rows of classifier-free guidance included),
a LoRA in float32 on every denoiser and nothing else trainable, and a backward from the velocity.
The sampler's update on the velocity (a few latent-sized float32 tensors) is left out: its
re-scoring checks read values, which shape-only tensors do not have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from peft import LoraConfig
from torch._subclasses.fake_tensor import FakeTensorMode

from rollout.condition import Condition
from rollout.guidance import Guidance
from rollout.sampling_params import SamplingParams
from trainers_adapters.policy.live_bytes import LiveTensorBytes
from trainers_adapters.policy.lora_policy import attach_lora as attach_policy_lora

LORA_NAME = "policy"


def attach_lora(adapter, lora_config: LoraConfig | Mapping) -> list[torch.nn.Parameter]:
    """`LoraPolicy`'s trainable LoRA on every denoiser of `adapter` (meta modules too: the plan
    attaches before the weights exist); returns the LoRA parameters."""
    attach_policy_lora(adapter, lora_config, LORA_NAME)
    return [p for denoiser in adapter.denoisers.values() for p in denoiser.parameters() if p.requires_grad]


def train_step_peak(
    adapter, params: SamplingParams, rows: int, guided: bool, *, fake: bool, encode_for_real: bool = False
) -> int:
    """Peak bytes a forward and backward of `rows` transitions add to `adapter` (LoRA attached),
    at `params`' size, frames and guidance (resolved by `adapter.spec.resolve`); `guided`: with the
    unconditional rows of classifier-free guidance where `params` turns it on (GRPO re-scores
    with them; DPO and NFT use the conditional velocity). `fake`: on shape-only tensors; the
    adapter's modules may then be on the meta device (they are given fake storage, never memory).
    Gradient checkpointing counts as the denoisers have it set (`enable_gradient_checkpointing`).
    `encode_for_real`: with `fake`, encode the prompts on real tensors first (the adapter's text
    encoders must then hold real storage: a real preset's small stand-ins), for the pipelines whose
    encoding reads values that shape-only tensors lack (Qwen's and Wan's masks select tokens)."""
    resolved, problems = adapter.spec.resolve(params)
    if problems:
        raise ValueError(f"the micro-batch's sampling settings do not fit the model: {'; '.join(problems)}")
    negative_prompt = resolved.negative_prompt if guided else None
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if fake:
        with mode:
            for name, module in adapter.components.items():
                if name in adapter.denoisers or not encode_for_real:
                    module.to_empty(device="cpu")  # fake storage of each weight's shape and dtype
    # Outside the fake mode: the text encoders' real storage (and the denoisers' fake one on the CPU,
    # the adapter's device) encode for real.
    encoded = _encode(adapter, resolved.max_sequence_length, negative_prompt) if encode_for_real else None
    # Real values even on fake tensors: a two-expert model (Wan 2.2) routes each row by its sigma.
    sigmas = torch.full((rows,), 0.5)
    with mode:
        prompt, negative = encoded or _encode(adapter, resolved.max_sequence_length, negative_prompt)
        shape = adapter.spec.latent_shape(resolved.height, resolved.width, resolved.num_frames)
        latents = torch.zeros(rows, *shape)
        guidance = Guidance.of(resolved)  # guided rows are those whose condition has a negative
        conditions = [Condition(prompt, negative)] * rows
        weights = [t for module in adapter.components.values() for t in (*module.parameters(), *module.buffers())]
        with LiveTensorBytes(weights) as live:
            velocity = adapter.predict_velocity(
                latents, sigmas, conditions, height=resolved.height, width=resolved.width, guidance=guidance
            )
            velocity.mean().backward()
            del velocity
    return live.peak_bytes


def _encode(adapter, length: int | None, negative_prompt: str | None) -> tuple:
    """The condition of one prompt and of the negative prompt (None: no CFG), as the trajectories
    carry them: encoded once, without gradients, outside the step."""
    with torch.no_grad():
        prompt = adapter.encode_prompts(["a photo"], length)[0]
        negative = None if negative_prompt is None else adapter.encode_prompts([negative_prompt], length)[0]
    return prompt, negative
