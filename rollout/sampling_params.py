"""How to sample one prompt: steps, guidance, sampler and noise, seeds, group size, adapter."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from rollout.pipelines.guidance import GUIDANCE_FIELDS
from rollout.samplers import LOG_PROB_FORMS, SAMPLERS, is_stochastic_step

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


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one prompt; `num_samples` samples (a GRPO group) are drawn from it.

    Fields named like an argument of the model's diffusers pipeline mean what that argument means
    there; None takes the model's default, and a field the model does not use is refused:
    guidance_scale: SD3's and Wan's classifier-free guidance; FLUX.1-dev's distilled guidance (an
        input of the model, no second pass).
    guidance_scale_2: Wan 2.2's guidance for its low-noise expert (`transformer_2`); None takes
        `guidance_scale`, as its pipeline does.
    true_cfg_scale: real classifier-free guidance for FLUX.1 and Qwen-Image (> 1 turns it on and
        needs a `negative_prompt`; Qwen-Image rescales the guided prediction to the conditional
        one's norm, as its pipeline does).
    negative_prompt: the unconditional branch of classifier-free guidance (SD3 uses "" when unset).
    max_sequence_length: text tokens the pipeline encodes (SD3's T5: 256, FLUX: 512 by default).
    num_frames: frames of a video (Wan: k * 4 + 1, 81 by default); image pipelines refuse it.
    log_prob_form: how stochastic steps write their log-prob, so that sampling, re-scoring and the
        ratio use one form: "gaussian" (the Gaussian log-density) or "flow_grpo" (what Flow-GRPO's
        step function computes: the same density for flow_sde and dance_sde; for cps
        -mean((x' - mean)^2), without the constants and the 1 / (2 std^2) factor, so its CPS
        log-ratios are the Gaussian ones times 2 std^2). A clip range tuned with Flow-GRPO's CPS
        needs "flow_grpo"; the docs' training page tabulates the forms.
    sde_window: half-open range `(start, stop)` of step indices that use the stochastic sampler;
        the other steps are deterministic ODE steps with `sde_mask` False. None means every step.
    seed: base seed; each sample's seed is derived from it, the prompt index and the sample index,
        so a sample does not depend on what else shares its batch. None draws a fresh base seed.
    same_noise_in_group: the samples of one prompt start from the same initial noise (their SDE
        noise still differs), as in Flow-GRPO.
    height, width: image size in pixels; None takes the model's default.
    sigmas: the noise levels of the steps, one per step, decreasing in (0, 1], passed to the
        scheduler as the model's diffusers pipeline passes `sigmas=` (its shift still applies);
        None takes the pipeline's schedule.
    branch_steps, branch_factor: tree rollouts (BranchGRPO, Flow-GRPO-Fast): before each listed
        step index every path of a sample splits into `branch_factor` children that continue from
        the same latents with their own step noise. `num_samples` counts the roots; each root
        yields `branch_factor ** len(branch_steps)` outputs, one per leaf. A branch step must be a
        stochastic step (children of an ODE step could not differ).
    branch_noise_scale: at a branch step the children draw their noise at this multiple of the
        step's std, and their log-probs are still scored with the step's own std, as BranchGRPO's
        published script does (its `tree_split_noise_scale`, 4.0 there). Re-scoring uses the same
        std, so the ratio stays 1; the log-prob is then not the density the child was drawn from.
        1 draws children like any other step.
    record: extra per-step tensors in the trajectory: "x0" (the model's clean-sample prediction
        x - sigma * v), "mean" and "std" (the sampler's transition, as re-scoring computes it).
    record_steps: keep trajectory entries (latents around the step, records) only for these step
        indices; None keeps every step. The final latents are always kept.
    output_type: "image" decodes; "latent" returns the final latents (`RolloutOutput.latents`)
        without decoding; "none" returns neither.
    """

    num_inference_steps: int = 10
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    max_sequence_length: int | None = None
    num_frames: int | None = None
    sampler: str = "flow_sde"
    noise_level: float = 0.7
    log_prob_form: str = "gaussian"
    sde_window: tuple[int, int] | None = None
    seed: int | None = None
    num_samples: int = 1
    same_noise_in_group: bool = False
    lora: str | None = None
    lora_scale: float = 1.0
    return_trajectory: bool = True
    output_type: str = "image"
    sigmas: tuple[float, ...] | None = None
    branch_steps: tuple[int, ...] = ()
    branch_factor: int = 2
    branch_noise_scale: float = 1.0
    record: tuple[str, ...] = ()
    record_steps: tuple[int, ...] | None = None

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
        if self.sampler not in SAMPLERS:
            problems.append(f"sampler must be one of {sorted(SAMPLERS)}, got {self.sampler!r}")
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
        if level == 0 and self.sampler in SAMPLERS and self.sampler != "ode":
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
        if not all(0 < s <= 1 for s in sigmas) or any(a <= b for a, b in itertools.pairwise(sigmas)):
            return [f"sigmas must decrease strictly and lie in (0, 1], got {tuple(sigmas)}"]
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
        if self.sampler in SAMPLERS:
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
        if self.sampler in SAMPLERS and not any(
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
