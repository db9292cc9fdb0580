"""How to sample one prompt: steps, guidance, sampler and noise, seeds, group size, adapter."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.samplers import SAMPLERS, is_stochastic_step


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one prompt; `num_samples` samples (a GRPO group) are drawn from it.

    Fields named like an argument of the model's diffusers pipeline mean what that argument means
    there; None takes the model's default, and a field the model does not use is refused:
    guidance_scale: SD3's classifier-free guidance; FLUX.1-dev's distilled guidance (an input of
        the model, no second pass).
    true_cfg_scale: real classifier-free guidance for FLUX.1 and Qwen-Image (> 1 turns it on and
        needs a `negative_prompt`; Qwen-Image rescales the guided prediction to the conditional
        one's norm, as its pipeline does).
    negative_prompt: the unconditional branch of classifier-free guidance (SD3 uses "" when unset).
    max_sequence_length: text tokens the pipeline encodes (SD3's T5: 256, FLUX: 512 by default).
    num_frames: for video pipelines; image pipelines refuse it.
    sde_window: half-open range `(start, stop)` of step indices that use the stochastic sampler;
        the other steps are deterministic ODE steps with `sde_mask` False. None means every step.
    seed: base seed; each sample's seed is derived from it, the prompt index and the sample index,
        so a sample does not depend on what else shares its batch. None draws a fresh base seed.
    same_noise_in_group: the samples of one prompt start from the same initial noise (their SDE
        noise still differs), as in Flow-GRPO.
    height, width: image size in pixels; None takes the model's default.
    """

    num_inference_steps: int = 10
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    max_sequence_length: int | None = None
    num_frames: int | None = None
    sampler: str = "flow_sde"
    noise_level: float = 0.7
    sde_window: tuple[int, int] | None = None
    seed: int | None = None
    num_samples: int = 1
    same_noise_in_group: bool = False
    lora: str | None = None
    lora_scale: float = 1.0
    return_trajectory: bool = True
    return_image: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.sde_window, list):  # YAML and JSON give lists
            object.__setattr__(self, "sde_window", tuple(self.sde_window))
        problems = self.problems()
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every problem with these settings, each naming the field and what is allowed."""
        problems = []
        steps = self.num_inference_steps
        if not isinstance(steps, int) or steps < 1:
            problems.append(f"num_inference_steps must be an integer >= 1, got {steps!r}")
        if self.sampler not in SAMPLERS:
            problems.append(f"sampler must be one of {sorted(SAMPLERS)}, got {self.sampler!r}")
        if self.noise_level < 0:
            problems.append(f"noise_level must be >= 0, got {self.noise_level}")
        elif self.noise_level == 0 and self.sampler in SAMPLERS and self.sampler != "ode":
            problems.append(
                f"noise_level 0 gives sampler {self.sampler!r} no noise and no log-prob; "
                "use sampler='ode' for deterministic sampling or a noise_level > 0"
            )
        for name in ("guidance_scale", "true_cfg_scale"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or value < 0):
                problems.append(f"{name} must be a number >= 0 or None, got {value!r}")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            problems.append(f"negative_prompt must be a str or None, got {self.negative_prompt!r}")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            problems.append(f"num_samples must be an integer >= 1, got {self.num_samples!r}")
        for name in ("height", "width", "max_sequence_length", "num_frames"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                problems.append(f"{name} must be a positive integer or None, got {value!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be an integer or None, got {self.seed!r}")
        if self.sde_window is not None and isinstance(steps, int) and steps >= 1:
            problems += self._window_problems(steps)
        return problems

    def _window_problems(self, steps: int) -> list[str]:
        window = self.sde_window
        if len(window) != 2 or not all(isinstance(i, int) for i in window):
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
