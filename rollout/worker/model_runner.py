"""One batched denoising step over requests that may sit at different step indices.

The runner builds per-sample vectors (sigma, sigma_next, guidance, noise level), asks the pipeline
adapter for velocities in one forward pass, and applies each sample's update rule: the SDE sampler
at its stochastic steps, the ODE elsewhere. Noise comes from each request's own generator, so a
sample's result does not depend on its batch-mates.

Nothing in a step makes the host wait for the device: each row's sigmas, scales and step noise are
built on the host (the noise from the requests' CPU generators, into one pinned buffer) and queued
to the device without waiting (`rollout.device_copy`), the rows of a pass or a rule are
host row numbers, never a boolean mask, and the history stays on the device until `finish` queues
its copies to pinned host memory and waits once for all of them.

Text is encoded once per distinct text: a new request reuses the embeddings of a live request with
the same prompt (or negative prompt), so every sample of a prompt references one conditioning, and
a finished trajectory names it by number (`rollout.worker.sent_conditions`): each crosses to the engine once.
An edit's input images are encoded once per distinct set of images (by digest) in the same way,
and cross the same way. Where the family's prompt encoding reads the images too (Qwen-Image-Edit),
a text is encoded once per (text, images): `ModelSpec.text_key`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rollout.condition import Condition, PromptEmbeds
from rollout.device_copy import host_buffer, host_to_device, row_index, synchronize, to_device, to_host
from rollout.guidance import Guidance
from rollout.lora.manager import LoraManager
from rollout.messages import FinishedRequest, Fork, NewRequestData
from rollout.model_spec import ModelSpec
from rollout.outputs import Trajectory
from rollout.samplers import get_sampler
from rollout.seeding import make_generator
from rollout.worker.path_history import PathHistory
from rollout.worker.sent_conditions import SentConditions

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """A worker's live state for one request (one path of a tree rollout)."""

    data: NewRequestData
    condition: Condition  # on the model's device and dtype, shared with the prompt's other samples
    encoder_generation: int  # the text encoders' weights the condition was encoded with
    timesteps: torch.Tensor  # [T] float32, CPU
    sigmas: torch.Tensor  # [T+1] float32, CPU
    sigma_values: list[float]  # `sigmas` as Python floats, read by every step without a tensor op
    sde_mask: list[bool]
    step_generator: torch.Generator
    latents: torch.Tensor  # [*latent_shape] float32 on the device: the current x_t
    history: PathHistory  # the latents and records this path keeps
    log_probs: list[torch.Tensor] = field(default_factory=list)  # [] float32 per step
    step_index: int = 0

    @property
    def done(self) -> bool:
        return self.step_index == len(self.sde_mask)

    def fork(self, child_id: str, step_noise_seed: int, prefix: PathHistory) -> RequestState:
        """A child that continues from this state's latents with its own step noise; `prefix` is
        this state's history sealed into shared parts (`PathHistory.seal`)."""
        return dataclasses.replace(
            self,
            data=dataclasses.replace(self.data, request_id=child_id, step_noise_seed=step_noise_seed),
            step_generator=make_generator(step_noise_seed),
            history=prefix.child(),
            log_probs=list(self.log_probs),
        )

    def encoded_texts(self, spec: ModelSpec) -> dict[tuple, PromptEmbeds]:
        """`spec.text_key` -> embeddings, for the texts this request holds."""
        params, images = self.data.params, self.data.images
        texts = {spec.text_key(self.data.prompt, params.max_sequence_length, images): self.condition.prompt}
        if self.condition.negative is not None:
            texts[spec.text_key(params.negative_prompt, params.max_sequence_length, images)] = self.condition.negative
        return texts

    def encoded_images(self) -> dict[str, PromptEmbeds]:
        """Images digest -> their encoding, for the input images this request holds (an edit)."""
        images = self.data.images
        return {} if images is None else {images.digest: self.condition.images}


class BatchLost(RuntimeError):
    """A step failed after its batch drew its noise: the states moved on and cannot be re-run to
    find which row failed, so every request of the batch fails with the original error."""


def describe(error: BaseException) -> str:
    """How a request's failure is reported: the error's type and message, never a traceback."""
    return f"{type(error).__name__}: {error}"


class ModelRunner:
    def __init__(self, adapter, loras: LoraManager, compile: str = "off"):
        self.adapter = adapter
        self.loras = loras
        self.compile = compile  # how the adapter's denoisers run (`EngineConfig.compile`), which trajectories record

    def prepare(
        self, new_requests: list[NewRequestData], live: Iterable[RequestState], encoder_generation: int
    ) -> tuple[list[RequestState], dict[str, str]]:
        """Encode the texts no live request holds (one at a time), draw initial noise, fetch
        schedules. Returns the new states, and the requests that failed (id -> error): a text that
        does not encode or a state that cannot be made fails its requests only.

        `encoder_generation` counts the text encoders' weight changes (the engine's count): a live
        request's embeddings are reused only when they were encoded at the same count."""
        if not new_requests:
            return [], {}
        spec = self.adapter.spec
        encoded: dict[tuple, PromptEmbeds] = {}
        encoded_images: dict[str, PromptEmbeds] = {}
        for state in live:
            if state.encoder_generation == encoder_generation:
                encoded |= state.encoded_texts(spec)
                encoded_images |= state.encoded_images()
        # (key, text, length, images): the images only where the prompt's encoding reads them.
        wanted = {}
        for r in new_requests:
            length, images = r.params.max_sequence_length, r.images if spec.prompt_reads_images else None
            for text in (r.prompt, r.params.negative_prompt):
                if text is not None:
                    wanted.setdefault(spec.text_key(text, length, images), (text, length, images))
        unencodable: dict[tuple | str, str] = {}
        for key, (text, length, images) in wanted.items():  # first-seen order, no repeats
            if key not in encoded:
                try:
                    encoded[key] = self.adapter.encode_prompts([text], length, images)[0]
                except Exception as error:
                    logger.warning("a text of %d characters did not encode", len(text), exc_info=True)
                    unencodable[key] = describe(error)
        for images in {r.images.digest: r.images for r in new_requests if r.images is not None}.values():
            if images.digest not in encoded_images:
                try:
                    with torch.no_grad():
                        encoded_images[images.digest] = self.adapter.encode_images(images)
                except Exception as error:
                    logger.warning("input images of sizes %s did not encode", images.sizes, exc_info=True)
                    unencodable[images.digest] = describe(error)
        states, failed = [], {}
        for data in new_requests:
            length = data.params.max_sequence_length
            bad = unencodable.get(spec.text_key(data.prompt, length, data.images)) or unencodable.get(
                spec.text_key(data.params.negative_prompt, length, data.images)
            )
            if bad is None and data.images is not None:
                bad = unencodable.get(data.images.digest)
            if bad is not None:
                failed[data.request_id] = bad
                continue
            try:
                images = encoded_images[data.images.digest] if data.images is not None else None
                states.append(self._new_state(data, encoded, images, encoder_generation))
            except Exception as error:
                logger.warning("request %s could not start", data.request_id, exc_info=True)
                failed[data.request_id] = describe(error)
        return states, failed

    def _new_state(
        self,
        data: NewRequestData,
        encoded: dict[tuple, PromptEmbeds],
        images: PromptEmbeds | None,
        encoder_generation: int,
    ) -> RequestState:
        params, spec = data.params, self.adapter.spec
        length = params.max_sequence_length
        negative = (
            encoded[spec.text_key(params.negative_prompt, length, data.images)]
            if params.negative_prompt is not None
            else None
        )
        timesteps, sigmas = self.adapter.schedule(
            params.num_inference_steps, params.height, params.width, params.sigmas, params.num_frames
        )
        shape = self.adapter.spec.latent_shape(params.height, params.width, params.num_frames)
        device = self.adapter.device
        initial = host_buffer(shape, device)
        torch.randn(shape, generator=make_generator(data.init_noise_seed), dtype=torch.float32, out=initial)
        initial = to_device(initial, device)
        history = PathHistory.for_params(params)
        history.add("latents", 0, initial)
        return RequestState(
            data=data,
            condition=Condition(encoded[spec.text_key(data.prompt, length, data.images)], negative, images),
            encoder_generation=encoder_generation,
            timesteps=timesteps,
            sigmas=sigmas,
            sigma_values=sigmas.tolist(),
            sde_mask=params.sde_mask(),
            step_generator=make_generator(data.step_noise_seed),
            latents=initial,
            history=history,
        )

    @staticmethod
    def fork(parent: RequestState, fork: Fork) -> list[RequestState]:
        """The children of `fork`; the parent's recorded history becomes one part they all share."""
        prefix = parent.history.seal(parent.data.request_id)
        return [parent.fork(child_id, seed, prefix) for child_id, seed in fork.children]

    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        """Advance every state by one denoising step, recording latents and log-probs.

        A failure in the forward pass leaves every state as it was (the caller may re-run the rows
        one by one); one after it raises `BatchLost`."""
        device = self.adapter.device
        latents = torch.stack([s.latents for s in states])
        # Each row's sigma, next sigma and noise level: built on the host, one copy that does not wait.
        sigma_values = [s.sigma_values[s.step_index] for s in states]
        sigma, sigma_next, noise_level = host_to_device(
            [
                sigma_values,
                [s.sigma_values[s.step_index + 1] for s in states],
                [s.data.params.noise_level for s in states],
            ],
            device,
            torch.float32,
        )
        params = states[0].data.params  # the scheduler batches one size, adapter and scale together
        self.loras.activate(params.lora, params.lora_scale)
        velocity = self.adapter.predict_velocity(
            latents,
            sigma_values,  # the host's floats: a family that picks an expert by them need not read the device
            [s.condition for s in states],
            height=params.height,
            width=params.width,
            guidance=Guidance.per_row([s.data.params for s in states], device),
        )

        try:
            self._apply_update(states, latents, velocity, sigma, sigma_next, noise_level)
        except Exception as error:
            raise BatchLost(
                f"a step of {len(states)} requests failed after its forward pass: {describe(error)}"
            ) from error

    def _apply_update(self, states, latents, velocity, sigma, sigma_next, noise_level) -> None:
        """Each state's update rule on the batch's velocity: draws the step noise, moves the states.
        One set of kernels per rule over its rows (one rule: the whole batch, no gather)."""
        device = velocity.device
        # Group samples by the rule they use at this step (their sampler and log-prob form if the
        # step is stochastic, the ODE otherwise).
        groups: dict[tuple[str, str], list[int]] = {}
        for i, s in enumerate(states):
            p = s.data.params
            rule = (p.sampler, p.log_prob_form) if s.sde_mask[s.step_index] else ("ode", "gaussian")
            groups.setdefault(rule, []).append(i)
        zero = torch.zeros((), dtype=torch.float32, device=device)  # log-prob of an ODE step
        x0 = None
        if any(s.step_index in s.history.kept_steps and s.history.wants("x0") for s in states):
            # x_t = (1 - sigma) x0 + sigma * noise and v = noise - x0
            x0 = latents.float() - sigma.view(-1, *([1] * (velocity.ndim - 1))) * velocity
        for (rule, log_prob_form), indices in groups.items():
            idx = row_index(indices, len(states), device)
            noise = None if rule == "ode" else _step_noise([states[i] for i in indices], device)
            out = get_sampler(rule)(
                latents[idx],
                velocity[idx],
                sigma[idx],
                sigma_next[idx],
                noise_level[idx],
                noise=noise,
                log_prob_form=log_prob_form,
            )
            for j, i in enumerate(indices):
                state = states[i]
                step, history = state.step_index, state.history
                if step in history.kept_steps:
                    if history.wants("x0"):
                        history.add("x0", step, x0[i])
                    history.add("mean", step, out.mean[j])
                    history.add("std", step, out.std[j].reshape(()))
                state.latents = out.prev_sample[j]
                history.add("latents", step + 1, state.latents)
                state.log_probs.append(out.log_prob[j] if out.log_prob is not None else zero)
                state.step_index += 1

    # Without autograd whatever a family's decode does: a VAE decoding with it on keeps every
    # activation for a backward that never comes (Wan's did: 28.8 GiB for one 33-frame 480x832 video).
    @torch.no_grad()
    def finish(
        self, states: list[RequestState], conditions: SentConditions
    ) -> tuple[list[FinishedRequest], dict[str, str]]:
        """Decode images (batched) and package trajectories of finished requests, on CPU, their
        conditions numbered by `conditions`. Returns them and the requests whose decode failed (id
        -> error; their size group's only)."""
        # The trajectories' copies are queued first, so they run while the images decode; one
        # wait covers them all (and the parts a fork sealed earlier: `PathHistory.seal`).
        trajectories = {s.data.request_id: self._trajectory(s) for s in states if s.data.params.return_trajectory}
        latents = {s.data.request_id: to_host(s.latents) for s in states if s.data.params.output_type == "latent"}
        to_decode = [s for s in states if s.data.params.output_type == "image"]
        decoded, sounds, failed = self._decode_by_shape(to_decode)
        synchronize(self.adapter.device)
        video = self.adapter.spec.is_video
        finished = []
        for s in states:
            request_id = s.data.request_id
            if request_id in failed:
                continue
            params = s.data.params
            finished.append(
                FinishedRequest(
                    request_id=request_id,
                    image=None if video else decoded.get(request_id),
                    video=decoded.get(request_id) if video else None,
                    audio=sounds.get(request_id),
                    latents=latents.get(request_id),
                    trajectory=trajectories.get(request_id),
                    condition=conditions.keys(s.condition) if params.return_trajectory else None,
                    part_nodes=s.history.part_nodes() if params.return_trajectory else {},
                )
            )
        return finished, failed

    def _decode_by_shape(
        self, states: list[RequestState]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
        """Request id -> its decoded image or video, batched per size; request id -> its sound (a
        model that makes one: `PipelineAdapter.decode_audio`); and the ids whose size group failed
        to decode (id -> error)."""
        by_size: dict[tuple[int, int, int | None], list[RequestState]] = {}
        for s in states:
            params = s.data.params
            by_size.setdefault((params.height, params.width, params.num_frames), []).append(s)
        decoded, sounds, failed = {}, {}, {}
        for (height, width, _), group in by_size.items():
            ids = [s.data.request_id for s in group]
            try:
                latents = torch.stack([s.latents for s in group])
                extra = {}
                if self.adapter.decode_reads_images:  # a video whose first frame is the condition's
                    images = [s.condition.images for s in group]
                    extra["images"] = type(images[0]).stack(images)
                media = self.adapter.decode(latents, height, width, **extra)
                audio = self.adapter.decode_audio(latents, height, width)
            except Exception as error:
                logger.warning("decoding %d requests of size %dx%d failed", len(group), height, width, exc_info=True)
                failed |= dict.fromkeys(ids, describe(error))
                continue
            decoded |= dict(zip(ids, media, strict=True))
            if audio is not None:
                sounds |= dict(zip(ids, audio, strict=True))
        return decoded, sounds, failed

    def _trajectory(self, state: RequestState) -> Trajectory:
        """The trajectory without its condition, which the engine attaches (see `FinishedRequest`)."""
        params = state.data.params
        series = state.history.series(len(state.sde_mask))  # copies queued: valid after `synchronize`
        return Trajectory(
            latents=series.pop("latents"),
            records=series,
            log_probs=to_host(torch.stack(state.log_probs)),
            timesteps=state.timesteps.clone(),
            sigmas=state.sigmas.clone(),
            sde_mask=torch.tensor(state.sde_mask, dtype=torch.bool),
            condition=None,
            height=params.height,
            width=params.width,
            sampler=params.sampler,
            noise_level=params.noise_level,
            log_prob_form=params.log_prob_form,
            guidance_scale=params.guidance_scale,
            guidance_scale_2=params.guidance_scale_2,
            true_cfg_scale=params.true_cfg_scale,
            num_frames=params.num_frames,
            lora_scale=params.lora_scale if params.lora is not None else None,
            compile=self.compile,
        )


def _step_noise(states: list[RequestState], device: torch.device) -> torch.Tensor:
    """The standard normal noise [B, *latent_shape] of the states' current step, each row from its
    state's own generator (so a row does not depend on its batch-mates), drawn on the host into one
    pinned buffer and queued to `device` in one copy: the draws run while the device computes, and
    give the numbers a separate draw per state gives. At a branch step a row is scaled by
    `branch_noise_scale` (BranchGRPO's children: drawn wider, scored with the step's std)."""
    noise = host_buffer((len(states), *states[0].latents.shape), device)
    for row, state in zip(noise, states, strict=True):
        torch.randn(row.shape, generator=state.step_generator, out=row)
        params = state.data.params
        if params.branch_noise_scale != 1 and state.step_index in params.branch_steps:
            row.mul_(params.branch_noise_scale)
    return to_device(noise, device)
