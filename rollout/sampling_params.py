"""How to sample one prompt: steps, guidance, sampler and noise, seeds, group size, adapter."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from rollout.guidance import GUIDANCE_FIELDS
from rollout.samplers import LOG_PROB_FORMS, SAMPLER_NAMES, is_stochastic_step
from rollout.settings import setting

OUTPUT_TYPES = ("image", "latent", "none")
RECORDS = ("x0", "mean", "std")
# Far past any published setting (guidance 1-10, noise levels up to 1.2): beyond them a step
# overflows (a guidance of 1e308 gave NaN log-probs and black images). CPS's noise scale
# sin(a * pi / 2) turns back past a = 1, so CPS takes noise levels up to 1.
MAX_GUIDANCE = 1000.0
# Past these no schedule or tree is meant, and checking one would cost what it asks for (the step
# masks hold a value per step); an engine's `RequestLimits` bound requests far below them.
MAX_INFERENCE_STEPS = 100_000
MAX_LEAVES_LOG2 = 24
MAX_NOISE_LEVEL = 10.0
MAX_LORA_SCALE = 100.0
# The smallest sigma a schedule may hold: that of the last step of the longest schedule
# (1 / MAX_INFERENCE_STEPS, where diffusers' flow-matching pipelines end theirs at 1 / steps). Far
# below it a stochastic step's noise is lost to float32 rounding beside the latents, and its
# variance to underflow (sigmas=[1e-30] finished with a NaN log-prob).
MIN_SIGMA = 1 / MAX_INFERENCE_STEPS


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one prompt; `num_samples` samples (a GRPO group) are drawn from it.

    Fields named like an argument of the model's diffusers pipeline mean what that argument means
    there; None takes the model's default, and a field the model does not use is refused. Each
    field's meaning is its `setting` help (`rollout.settings.setting_help`), which the recipes'
    `sampling` section shows as it is; the docs' training page tabulates the log-prob forms.
    """

    num_inference_steps: int = setting(10, "denoising steps per sample")
    guidance_scale: float | None = setting(
        None,
        "SD3, Wan: classifier-free guidance (<= 1 skips the unconditional pass); Z-Image: classifier-free "
        "guidance as cond + s * (cond - uncond) (0 skips it); FLUX.1-dev: its distilled guidance, an input of the "
        "model (no second pass); None takes the model's default; refused where unused (Qwen-Image)",
    )
    guidance_scale_2: float | None = setting(
        None,
        "Wan 2.2: guidance of its low-noise expert (transformer_2); None takes guidance_scale, as its pipeline "
        "does; refused elsewhere",
    )
    true_cfg_scale: float | None = setting(
        None,
        "FLUX.1, Qwen-Image: real classifier-free guidance (> 1 turns it on and needs a negative_prompt; "
        "Qwen-Image rescales the guided prediction to the conditional one's norm, as its pipeline does); None "
        "takes the model's default (1: off); refused by SD3",
    )
    negative_prompt: str | None = setting(
        None, "text of the unconditional branch of classifier-free guidance; None: SD3 uses ''"
    )
    auto_resize: bool | None = setting(
        None,
        "FLUX.1 Kontext: its pipeline's _auto_resize: the input image is resized to the nearest (by aspect ratio) of "
        "the pipeline's PREFERRED_KONTEXT_RESOLUTIONS, about a megapixel, before it is encoded, and an edit that sets "
        "no size is made at that size; false encodes it at its own size; None takes the pipeline's default (true); "
        "refused by the other families",
    )
    height: int | None = setting(None, "image height in pixels; None takes the model's default")
    width: int | None = setting(None, "image width in pixels; None takes the model's default")
    max_sequence_length: int | None = setting(
        None, "text tokens encoded per prompt; None takes the pipeline's default (SD3's T5: 256, FLUX: 512)"
    )
    num_frames: int | None = setting(
        None,
        "frames of a video (Wan: k * s + 1 for the VAE's temporal scale s: 4 for Wan's VAE, 2 for the tiny one; "
        "81 by default); image pipelines refuse it",
    )
    sampler: str = setting("flow_sde", "update rule: ode, flow_sde, cps or dance_sde")
    noise_level: float = setting(
        0.7, "SDE noise strength (Flow-GRPO's a, DanceGRPO's eta); > 0 for a stochastic sampler, <= 1 for cps"
    )
    log_prob_form: str = setting(
        "gaussian",
        "how stochastic steps write their log-prob, so that sampling, re-scoring and the ratio use one form: "
        "gaussian (the Gaussian log-density) or flow_grpo (Flow-GRPO's step function: the same density for "
        "flow_sde and dance_sde; for cps -mean((x' - mean)^2), without the constants and the 1 / (2 std^2) "
        "factor, so its log-ratios are the Gaussian ones times 2 std^2: a clip range tuned with Flow-GRPO's CPS "
        "needs it)",
    )
    sde_window: tuple[int, int] | None = setting(
        None,
        "half-open range [start, stop) of step indices that use the stochastic sampler; the others are "
        "deterministic ODE steps (sde_mask False); None means every step",
    )
    seed: int | None = setting(
        None,
        "base seed; each sample's seed derives from it, the prompt index and the sample index, so a sample does "
        "not depend on what shares its batch; None draws a fresh base seed",
    )
    num_samples: int = setting(1, "samples per prompt (the GRPO group size)")
    same_noise_in_group: bool = setting(
        False,
        "the samples of a prompt start from the same initial noise (their SDE noise still differs), as in Flow-GRPO",
    )
    lora: str | None = setting(None, "name of a loaded LoRA adapter to sample with; None: the base model")
    lora_scale: float = setting(1.0, "strength of that adapter")
    return_trajectory: bool = setting(True, "return the trajectory: latents, log-probs, sigmas and timesteps")
    output_type: str = setting(
        "image", "image (decode), latent (the final latents in RolloutOutput.latents, no decode) or none (neither)"
    )
    sigmas: tuple[float, ...] | None = setting(
        None,
        "the noise levels of the steps, one per step, decreasing in [1e-5, 1], passed to the scheduler as the "
        "model's diffusers pipeline passes sigmas= (its shift still applies); None takes the pipeline's schedule",
    )
    branch_steps: tuple[int, ...] = setting(
        (),
        "tree rollouts (BranchGRPO, Flow-GRPO-Fast): step indices before which every path of a sample splits "
        "into branch_factor children that continue from its latents with their own noise; each root then yields "
        "branch_factor ** len(branch_steps) outputs, one per leaf; each must be a stochastic step",
    )
    branch_factor: int = setting(2, "children per path at each branch step")
    branch_noise_scale: float = setting(
        1.0,
        "children of a branch step draw their noise at this multiple of the step's std and are still scored "
        "with its std, as BranchGRPO's script does (its tree_split_noise_scale, 4.0 there); re-scoring keeps "
        "ratio 1, but the log-prob is then not the density the child was drawn from; 1: like any step",
    )
    record: tuple[str, ...] = setting(
        (),
        "extra per-step tensors in the trajectory: x0 (the clean-sample prediction x - sigma * v), mean and std "
        "(the sampler's transition, as re-scoring computes it)",
    )
    record_steps: tuple[int, ...] | None = setting(
        None,
        "keep trajectory entries (latents around the step, records) only for these step indices; None keeps "
        "every step; the final latents are always kept",
    )

    def __post_init__(self) -> None:
        for name in ("sde_window", "sigmas", "branch_steps", "record", "record_steps"):
            if isinstance(getattr(self, name), list):  # YAML and JSON give lists
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = self.problems()
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every problem with these settings, each naming the field and what is allowed."""
        problems = []
        steps = self.num_inference_steps
        if not _is_int(steps) or steps < 1:
            problems.append(f"num_inference_steps must be an integer >= 1, got {steps!r}")
        elif steps > MAX_INFERENCE_STEPS:
            problems.append(f"num_inference_steps must be at most {MAX_INFERENCE_STEPS}, got {steps}")
        if self.sampler not in SAMPLER_NAMES:
            problems.append(f"sampler must be one of {sorted(SAMPLER_NAMES)}, got {self.sampler!r}")
        problems += self._noise_level_problems()
        if self.log_prob_form not in LOG_PROB_FORMS:
            problems.append(f"log_prob_form must be one of {LOG_PROB_FORMS}, got {self.log_prob_form!r}")
        for name in GUIDANCE_FIELDS:
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and 0 <= value <= MAX_GUIDANCE):
                problems.append(f"{name} must be a number in [0, {MAX_GUIDANCE:g}] or None, got {value!r}")
        if not (_is_number(self.lora_scale) and abs(self.lora_scale) <= MAX_LORA_SCALE):
            problems.append(
                f"lora_scale must be a number in [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}], got {self.lora_scale!r}"
            )
        for name in ("negative_prompt", "lora"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                problems.append(f"{name} must be a str or None, got {getattr(self, name)!r}")
        if not _is_int(self.num_samples) or self.num_samples < 1:
            problems.append(f"num_samples must be an integer >= 1, got {self.num_samples!r}")
        for name in ("height", "width", "max_sequence_length", "num_frames"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                problems.append(f"{name} must be a positive integer or None, got {value!r}")
        if self.seed is not None and not _is_int(self.seed):
            problems.append(f"seed must be an integer or None, got {self.seed!r}")
        if self.auto_resize is not None and not isinstance(self.auto_resize, bool):
            problems.append(f"auto_resize must be true, false or None, got {self.auto_resize!r}")
        for name in ("same_noise_in_group", "return_trajectory"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.output_type not in OUTPUT_TYPES:
            problems.append(f"output_type must be one of {OUTPUT_TYPES}, got {self.output_type!r}")
        if isinstance(self.record, str) or not set(self.record) <= set(RECORDS):
            problems.append(f"record must be a tuple of names from {RECORDS}, got {self.record!r}")
        if _is_int(steps) and 1 <= steps <= MAX_INFERENCE_STEPS:
            window = self._window_problems(steps) if self.sde_window is not None else []
            problems += window
            problems += self._sigmas_problems(steps)
            problems += self._step_list_problems("record_steps", self.record_steps, steps)
            if not window:  # the branch checks read the window
                problems += self._branch_problems(steps)
        return problems

    def _noise_level_problems(self) -> list[str]:
        level = self.noise_level
        most = 1.0 if self.sampler == "cps" else MAX_NOISE_LEVEL
        if not _is_number(level):
            return [f"noise_level must be a finite number, got {level!r}"]
        if level < 0:
            return [f"noise_level must be >= 0, got {level}"]
        if level > most:
            why = " for CPS, whose sin(a * pi / 2) turns back past 1" if self.sampler == "cps" else ""
            return [f"noise_level must be <= {most:g}{why}, got {level}"]
        if level == 0 and self.sampler in SAMPLER_NAMES and self.sampler != "ode":
            return [
                f"noise_level 0 gives sampler {self.sampler!r} no noise and no log-prob; "
                "use sampler='ode' for deterministic sampling or a noise_level > 0"
            ]
        return []

    @property
    def leaves_per_sample(self) -> int:
        """Outputs each of the `num_samples` roots yields."""
        return self.branch_factor ** len(self.branch_steps)

    def _sigmas_problems(self, steps: int) -> list[str]:
        sigmas = self.sigmas
        if sigmas is None:
            return []
        if not all(_is_number(s) for s in sigmas):
            return [f"sigmas must be numbers, got {sigmas!r}"]
        if len(sigmas) != steps:
            return [
                f"sigmas has {len(sigmas)} entries but num_inference_steps is {steps}; "
                f"pass one sigma per step (num_inference_steps={len(sigmas)})"
            ]
        if not all(MIN_SIGMA <= s <= 1 for s in sigmas) or any(a <= b for a, b in itertools.pairwise(sigmas)):
            return [
                f"sigmas must decrease strictly and lie in [{MIN_SIGMA:g}, 1] (below {MIN_SIGMA:g} a step's noise is "
                f"lost to float32 rounding and its log-prob is not a number), got {tuple(sigmas)}"
            ]
        return []

    @staticmethod
    def _step_list_problems(name: str, indices: tuple | None, steps: int) -> list[str]:
        if indices is None:
            return []
        if not all(_is_int(i) and 0 <= i < steps for i in indices):
            return [f"{name} must be step indices in [0, {steps}), got {indices!r}"]
        if any(a >= b for a, b in itertools.pairwise(indices)):
            return [f"{name} must be increasing without repeats, got {tuple(indices)}"]
        return []

    def _branch_problems(self, steps: int) -> list[str]:
        if not _is_int(self.branch_factor) or self.branch_factor < 1:
            return [f"branch_factor must be an integer >= 1, got {self.branch_factor!r}"]
        if not self.branch_steps:
            return self._branch_noise_problems()
        problems = self._step_list_problems("branch_steps", self.branch_steps, steps)
        if problems:
            return problems
        if len(self.branch_steps) * math.log2(self.branch_factor) > MAX_LEAVES_LOG2:
            return [
                f"branch_factor {self.branch_factor} at {len(self.branch_steps)} branch steps makes more than "
                f"2**{MAX_LEAVES_LOG2} leaves per sample"
            ]
        if self.branch_factor < 2:
            problems.append(f"branch_factor must be >= 2 to branch at steps {self.branch_steps}")
        problems += self._branch_noise_problems()
        if self.sampler in SAMPLER_NAMES:
            mask = self.sde_mask()
            deterministic = [i for i in self.branch_steps if not mask[i]]
            if deterministic:
                problems.append(
                    f"branch_steps {deterministic} are ODE steps of this schedule (sampler {self.sampler!r}, "
                    f"sde_window {self.sde_window}), where children could not differ; branch at a stochastic step"
                )
        return problems

    def _branch_noise_problems(self) -> list[str]:
        scale = self.branch_noise_scale
        if not _is_number(scale) or scale <= 0:
            return [f"branch_noise_scale must be a finite number > 0, got {scale!r}"]
        if scale != 1 and not self.branch_steps:
            return [f"branch_noise_scale {scale} scales the noise of branch steps, but branch_steps is empty"]
        return []

    def _window_problems(self, steps: int) -> list[str]:
        window = self.sde_window
        if len(window) != 2 or not all(_is_int(i) for i in window):
            return [f"sde_window must be a pair (start, stop) of step indices, got {window!r}"]
        start, stop = window
        if not 0 <= start < stop <= steps:
            return [
                f"sde_window {tuple(window)} is outside the step range: need 0 <= start < stop <= "
                f"num_inference_steps ({steps})"
            ]
        if self.sampler in SAMPLER_NAMES and not any(
            is_stochastic_step(self.sampler, i, steps) for i in range(start, stop)
        ):
            return [f"sde_window {tuple(window)} holds no stochastic step of sampler {self.sampler!r}"]
        return []

    def sde_mask(self) -> list[bool]:
        """Per step index: does this step use the stochastic sampler (and carry a log-prob)?"""
        steps = self.num_inference_steps
        start, stop = self.sde_window if self.sde_window is not None else (0, steps)
        return [start <= i < stop and is_stochastic_step(self.sampler, i, steps) for i in range(steps)]


def _is_int(value) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
