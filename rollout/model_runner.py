"""One batched denoising step over requests that may sit at different step indices.

The runner builds per-sample vectors (sigma, sigma_next, guidance, noise level), asks the pipeline
adapter for velocities in one forward pass, and applies each sample's update rule: the SDE sampler
at its stochastic steps, the ODE elsewhere. Noise comes from each request's own generator, so a
sample's result does not depend on its batch-mates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.lora import LoraManager
from rollout.outputs import Trajectory
from rollout.pipelines.condition import Condition
from rollout.request import NewRequestData
from rollout.samplers import get_sampler
from rollout.seeding import make_generator


@dataclass
class RequestState:
    """A worker's live state for one request."""

    data: NewRequestData
    condition: Condition  # on the model's device and dtype
    timesteps: torch.Tensor  # [T] float32, CPU
    sigmas: torch.Tensor  # [T+1] float32, CPU
    sde_mask: list[bool]
    step_generator: torch.Generator
    latents: torch.Tensor  # [C, h, w] float32 on the device: the current x_t
    history: list[torch.Tensor]  # latents after each step, index 0 the initial noise
    log_probs: list[torch.Tensor] = field(default_factory=list)  # [] float32 per step
    step_index: int = 0

    @property
    def done(self) -> bool:
        return self.step_index == len(self.sde_mask)


@dataclass
class FinishedRequest:
    request_id: str
    image: torch.Tensor | None  # [3, H, W] uint8, CPU
    trajectory: Trajectory | None


@dataclass
class RunnerOutput:
    """What one worker returns for one engine step."""

    finished: list[FinishedRequest] = field(default_factory=list)
    compute_s: float = 0.0  # time spent in this worker's step, for overhead accounting


class ModelRunner:
    def __init__(self, adapter, loras: LoraManager):
        self.adapter = adapter
        self.loras = loras

    def prepare(self, new_requests: list[NewRequestData]) -> list[RequestState]:
        """Encode prompts (once per distinct prompt), draw initial noise, fetch schedules."""
        if not new_requests:
            return []
        prompts = sorted({r.prompt for r in new_requests})
        conditions = dict(zip(prompts, self.adapter.encode_prompts(prompts), strict=True))
        states = []
        for data in new_requests:
            shape = self.adapter.spec.latent_shape(data.height, data.width)
            timesteps, sigmas = self.adapter.schedule(data.params.num_inference_steps, shape[1:])
            initial = torch.randn(shape, generator=make_generator(data.init_noise_seed), dtype=torch.float32)
            initial = initial.to(self.adapter.device)
            states.append(
                RequestState(
                    data=data,
                    condition=conditions[data.prompt],
                    timesteps=timesteps,
                    sigmas=sigmas,
                    sde_mask=data.params.sde_mask(),
                    step_generator=make_generator(data.step_noise_seed),
                    latents=initial,
                    history=[initial],
                )
            )
        return states

    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        """Advance every state by one denoising step, recording latents and log-probs."""
        device = self.adapter.device
        latents = torch.stack([s.latents for s in states])
        sigma = torch.stack([s.sigmas[s.step_index] for s in states]).to(device)
        sigma_next = torch.stack([s.sigmas[s.step_index + 1] for s in states]).to(device)
        guidance = torch.tensor([s.data.params.guidance_scale for s in states], dtype=torch.float32)
        noise_level = torch.tensor([s.data.params.noise_level for s in states], dtype=torch.float32).to(device)
        condition = Condition.stack([s.condition for s in states])
        params = states[0].data.params  # the scheduler batches one adapter and scale together
        self.loras.activate(params.lora, params.lora_scale)
        velocity = self.adapter.predict_velocity(latents, sigma, condition, guidance.to(device))

        # Group samples by the rule they use at this step: their sampler if the step is stochastic,
        # the ODE otherwise.
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(states):
            rule = s.data.params.sampler if s.sde_mask[s.step_index] else "ode"
            groups.setdefault(rule, []).append(i)
        zero = torch.zeros((), dtype=torch.float32, device=device)  # log-prob of an ODE step
        for rule, indices in groups.items():
            # One rule for the whole batch (the common case) needs no gather.
            idx = slice(None) if len(indices) == len(states) else torch.tensor(indices, device=device)
            noise = None
            if rule != "ode":
                noise = torch.stack(
                    [torch.randn(states[i].latents.shape, generator=states[i].step_generator) for i in indices]
                ).to(device)
            out = get_sampler(rule)(
                latents[idx], velocity[idx], sigma[idx], sigma_next[idx], noise_level[idx], noise=noise
            )
            for j, i in enumerate(indices):
                state = states[i]
                state.latents = out.prev_sample[j]
                state.history.append(state.latents)
                state.log_probs.append(out.log_prob[j] if out.log_prob is not None else zero)
                state.step_index += 1

    def finish(self, states: list[RequestState]) -> list[FinishedRequest]:
        """Decode images (batched) and package trajectories of finished requests, on CPU."""
        to_decode = [s for s in states if s.data.params.return_image]
        images = {}
        if to_decode:
            decoded = self._decode_by_shape(to_decode)
            images = {s.data.request_id: img for s, img in zip(to_decode, decoded, strict=True)}
        return [
            FinishedRequest(
                request_id=s.data.request_id,
                image=images.get(s.data.request_id),
                trajectory=self._trajectory(s) if s.data.params.return_trajectory else None,
            )
            for s in states
        ]

    def _decode_by_shape(self, states: list[RequestState]) -> list[torch.Tensor]:
        images: list[torch.Tensor | None] = [None] * len(states)
        by_shape: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            by_shape.setdefault(tuple(s.latents.shape), []).append(i)
        for indices in by_shape.values():
            decoded = self.adapter.decode(torch.stack([states[i].latents for i in indices]))
            for j, i in enumerate(indices):
                images[i] = decoded[j]
        return images

    @staticmethod
    def _trajectory(state: RequestState) -> Trajectory:
        params = state.data.params
        condition = state.condition.to("cpu", torch.float32)
        return Trajectory(
            latents=torch.stack(state.history).to("cpu", torch.float32),
            log_probs=torch.stack(state.log_probs).to("cpu", torch.float32),
            timesteps=state.timesteps.clone(),
            sigmas=state.sigmas.clone(),
            sde_mask=torch.tensor(state.sde_mask, dtype=torch.bool),
            condition=condition,
            sampler=params.sampler,
            noise_level=params.noise_level,
            guidance_scale=params.guidance_scale,
        )
