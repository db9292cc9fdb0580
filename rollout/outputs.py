"""What the engine returns: one `RolloutOutput` per sample, with its `Trajectory`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.condition import Condition
from rollout.node_id import NamedByNode, NodeId
from rollout.reprs import dataclass_repr
from rollout.step_series import StepSeries

# The plain-value fields of a `Trajectory` that say how its steps were computed: what re-scoring
# needs beside its tensors, and what the transitions of one batched re-score must share.
TRAJECTORY_SETTINGS = (
    "height",
    "width",
    "num_frames",
    "sampler",
    "noise_level",
    "log_prob_form",
    "guidance_scale",
    "guidance_scale_2",
    "true_cfg_scale",
    "lora_scale",
    "compile",
)


@dataclass
class Trajectory:
    """Everything a policy-gradient trainer needs to re-score the denoising chain of one sample.

    latents: the chain x_0..x_T as a `StepSeries` of float32 entries that answers like a
        [T+1, *latent_shape] tensor: `latents[i]` is x_i (0 the initial noise, T or -1 the final
        latents), `latents[1:-1]` and `latents[steps]` give several, `latents.shape` and
        `torch.stack([t.latents for t in trajectories])` work, `latents.stack()` is the tensor. Each entry has
        the form the model's diffusers pipeline takes as `latents=`: [C, h, w] for SD3, packed 2x2
        patches [h/2 * w/2, C*4] for FLUX.1 and Qwen-Image. With `record_steps` only the entries
        around those steps (and x_T) are kept, and torch functions and iteration refuse the series
        (its k-th kept entry is not step k); the leaves of a tree rollout share their prefix.
    log_probs: [T] float32; log-density of latents[i+1] given latents[i] for SDE steps (averaged
        over the latent's elements), 0 where `sde_mask` is False.
    timesteps: [T] float32, the model timesteps (sigma * num_train_timesteps).
    sigmas: [T+1] float32, noise levels; sigmas[T] = 0.
    sde_mask: [T] bool, which steps were stochastic.
    condition: the prompt (and, with classifier-free guidance, negative prompt) embeddings the
        velocities were computed with, float32; shared with the other samples of the prompt.
    height, width: the image size in pixels (packed latents do not show it); num_frames: a video's
        frames (None for images).
    sampler, noise_level, log_prob_form, guidance_scale, true_cfg_scale, guidance_scale_2: what
        the steps used (None where the model does not use a guidance field), so re-scoring needs
        nothing else.
    lora_scale: the strength the request's LoRA adapter ran at (`SamplingParams.lora_scale`); None
        for a sample of the base model (no adapter). `LoraPolicy.score` re-scores at this scale.
    compile: how the engine ran its denoisers (`EngineConfig.compile`): "off" (eager) or "blocks"
        (compiled transformer blocks). Compiled and eager kernels round differently; the bound a
        trainer's re-score keeps for each pairing is in docs/engine.md ("Compiled blocks").
    records: the per-step tensors `SamplingParams.record` asked for, each a `StepSeries` over the
        T steps (at `record_steps`): "x0" the clean-sample prediction x_i - sigma_i * v_i, "mean"
        and "std" the transition x_i -> x_{i+1} (std 0 at ODE steps).
    """

    latents: StepSeries
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    sde_mask: torch.Tensor
    condition: Condition
    height: int
    width: int
    sampler: str
    noise_level: float
    guidance_scale: float | None
    true_cfg_scale: float | None
    guidance_scale_2: float | None = None
    num_frames: int | None = None
    log_prob_form: str = "gaussian"
    lora_scale: float | None = None
    compile: str = "off"
    records: dict[str, StepSeries] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[0]

    @property
    def kept_steps(self) -> torch.Tensor:
        """Step indices whose transition x_i -> x_{i+1} is kept (every step unless `record_steps`)."""
        kept = [i for i in range(self.num_steps) if i in self.latents and i + 1 in self.latents]
        return torch.tensor(kept, dtype=torch.int64)

    @property
    def scorable_steps(self) -> torch.Tensor:
        """The stochastic steps whose transition is kept: those a trainer can re-score."""
        kept = torch.zeros(self.num_steps, dtype=torch.bool)
        kept[self.kept_steps] = True
        return (self.sde_mask & kept).nonzero(as_tuple=True)[0]

    def __repr__(self) -> str:  # one line of shapes and settings, not the tensors' values
        return dataclass_repr(self)


@dataclass
class RequestTimings:
    """Wall-clock seconds of one request's life in the engine."""

    queued_s: float = 0.0  # from add_request to its first denoising step
    denoise_s: float = 0.0  # from its first step to its last
    total_s: float = 0.0  # from add_request to the output


@dataclass
class RolloutOutput(NamedByNode):
    """One generated sample. Tensors are on CPU.

    node_id: which sample it is, as data: its group (the id `add_request` was given or made), its
        sample index in the group and its `branch_path`. `request_id`, `group_id`, `sample_index`
        and `branch_path` read it; `request_id` (`str(node_id)`) is its id on the wire and in logs.
    status: "finished"; "aborted"; or "failed": the worker raised for this request alone, `error`
        says what ("ValueError: ..."), and its batch-mates went on. Without "finished", image,
        latents and trajectory are None.
    image: [3, H, W] uint8 with output_type "image", else None (and None for video models).
    video: [F, 3, H, W] uint8 frames of a video model with output_type "image", else None.
    latents: the final latents [*latent_shape] float32 with output_type "latent", else None.
    audio: [channels, samples] float32 waveform in [-1, 1] of a video model that makes sound with
        its frames (LTX-2) with output_type "image", else None; audio_sample_rate: its samples per second.
    branch_path: in a tree rollout, the child taken at each branch step; () without branching.
    weight_version: the engine's weight version of the sample's last step.
    weight_versions: every version its steps used, in order (more than one only when an update
        with mode="pause" landed while it ran).
    step_weight_versions: the version each denoising step ran with, one per step (the step whose
        log-prob `trajectory.log_probs[i]` holds ran with `step_weight_versions[i]`): what an
        off-policy trainer reads to know which behaviour policy made each step.
    """

    node_id: NodeId
    prompt: str
    prompt_index: int
    seed: int
    status: str = "finished"
    image: torch.Tensor | None = None
    video: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    audio_sample_rate: int | None = None
    trajectory: Trajectory | None = None
    weight_version: int = 0
    weight_versions: tuple[int, ...] = ()
    step_weight_versions: tuple[int, ...] = ()
    lora: str | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    error: str | None = None

    def __repr__(self) -> str:  # one line: which sample, its status, shapes and versions
        return dataclass_repr(
            self, {"request_id": self.request_id}, hidden=("node_id", "timings", "step_weight_versions")
        )
