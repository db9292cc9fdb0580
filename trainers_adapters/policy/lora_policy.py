"""The trainer's own trainable copy of the policy: the pipeline adapter with a PEFT LoRA on its
transformer (on each of Wan 2.2's two experts). It re-scores rollouts with gradients through the
same `predict_velocity` and sampler functions the engine sampled with, and hands its LoRA tensors
to `engine.load_lora`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
from diffusers.loaders.lora_base import LoraBaseMixin
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout import RolloutEngine
from rollout.api import DEFAULT_COMPONENT
from rollout.condition import Condition
from rollout.guidance import Guidance
from rollout.lora.manager import (
    DIFFUSERS_LORA_FILE,
    DIFFUSERS_LORA_FILE_2,
    adapter_to_float32,
    read_lora_folder,
    split_by_component,
)
from rollout.outputs import TRAJECTORY_SETTINGS, Trajectory
from rollout.pipelines.families import families_of
from rollout.pipelines.loading import load_adapter
from rollout.rescoring import check_scorable, score_steps
from rollout.samplers import StepOutput
from rollout.weights.state import base_state, checksum, specs_of, update_problems
from rollout.worker.shared_base import share_base
from trainers_adapters.policy.checkpointing import enable_gradient_checkpointing


def attach_lora(adapter, lora_config: LoraConfig | Mapping, name: str, seed: int | None = None) -> LoraConfig:
    """Add a trainable float32 LoRA `name` to every denoiser of `adapter` (a pipeline adapter; its
    modules may be on the meta device), the base frozen, and pick it; returns its config, with the
    family's default targets where `lora_config` names none. `seed`: the LoRA's initial values
    are drawn right after seeding torch's generators with it (and the generators are restored),
    so they do not depend on what loading the base drew (a text encoder's loading draws, sharing
    an engine's base draws nothing); None: drawn from the generators as they are."""
    config = lora_config if isinstance(lora_config, LoraConfig) else LoraConfig(**lora_config)
    if config.target_modules is None:
        config = dataclasses.replace(config, target_modules=set(adapter.default_lora_targets))
    with torch.random.fork_rng(enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        for denoiser in adapter.denoisers.values():
            denoiser.requires_grad_(False)
            denoiser.add_adapter(config, adapter_name=name)
            denoiser.set_adapters([name])
            adapter_to_float32(denoiser, name)  # trained in float32, and the engine computes with float32 too
    return config


class LoraPolicy:
    """A frozen base model plus one trainable LoRA adapter named `name` on every denoiser (the
    transformer; both experts of Wan 2.2). A config that names no `target_modules` gets the model
    family's default targets. `attention_backend`: as the engine's (`EngineConfig.attention_backend`),
    so the policy re-scores with the attention kernel that sampled. `compile`: as `EngineConfig.compile`
    ("blocks": the denoisers' transformer blocks compiled, gradients through them; see docs/engine.md
    for the re-score bound). `gradient_checkpointing`: every denoiser keeps only its blocks' inputs in
    a forward with gradients and recomputes their activations in the backward (diffusers' own, with
    compiled blocks too: `trainers_adapters.policy.checkpointing`): the same gradients, a lower
    activation peak, one more forward of the blocks per backward. `seed`: the LoRA's initial values
    come from it alone (`attach_lora`), the same whether the base is loaded or shared."""

    def __init__(
        self,
        model: str,
        lora_config: LoraConfig | Mapping,
        name: str = "policy",
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_backend: str | None = None,
        compile: str = "off",
        gradient_checkpointing: bool = False,
        seed: int | None = None,
    ):
        adapter = load_adapter(model, device, dtype, attention_backend, compile)
        self._attach(adapter, str(model), name, lora_config, gradient_checkpointing=gradient_checkpointing, seed=seed)

    @classmethod
    def sharing_base(
        cls,
        engine: RolloutEngine,
        lora_config: LoraConfig | Mapping,
        name: str = "policy",
        gradient_checkpointing: bool = False,
        seed: int | None = None,
    ) -> LoraPolicy:
        """A policy whose denoisers share the frozen base weights of `engine`, a `RolloutEngine`
        in this process (executor 'uni'): one copy of the base for engine and trainer (colocated
        training). The policy's denoisers are module trees of its own whose every base tensor is
        the engine's (the same storage); it loads nothing else (trajectories carry the conditions),
        its LoRA is in its trees only (the engine's adapters are in the engine's), and it re-scores
        with the engine's dtype, device, attention backend and compiled blocks; its own trees
        recompute their activations in the backward with `gradient_checkpointing` (the engine's
        modules are untouched).

        The engine's `update_weights` changes the policy's base with its own (so `load_base_weights`
        is refused); a LoRA the engine merges (`merge_lora`) never reaches the policy, since a merge
        points the engine's weights at new tensors and leaves the base's storage untouched; the
        engine's `sleep` is refused while the policy lives (it would free nothing). Any other engine
        (executor 'mp' or 'ray', a server's client, the async engine) is a ValueError."""
        if not (isinstance(engine, RolloutEngine) and engine.executor.shares_memory):
            where = (
                f"executor {engine.config.executor!r}" if isinstance(engine, RolloutEngine) else type(engine).__name__
            )
            raise ValueError(
                "LoraPolicy.sharing_base shares the base weights of an engine whose worker runs in this process, and "
                f"this engine is a {where}: build it with RolloutEngine(EngineConfig(..., executor='uni')) "
                "in the trainer's process, or give the trainer its own copy with LoraPolicy(model, lora_config)"
            )
        (adapter,) = engine.collective_rpc(share_base)
        policy = cls.__new__(cls)
        policy._attach(adapter, engine.config.model, name, lora_config, True, gradient_checkpointing, seed)
        return policy

    def _attach(
        self,
        adapter,
        model: str,
        name: str,
        lora_config: LoraConfig | Mapping,
        shares_base: bool = False,
        gradient_checkpointing: bool = False,
        seed: int | None = None,
    ) -> None:
        """Add the trainable adapter `name` to every denoiser of `adapter` (a pipeline adapter),
        initialised under `seed` (`attach_lora`), with its denoisers' blocks checkpointed if
        `gradient_checkpointing`."""
        self.adapter = adapter
        self.model = model
        self.name = name
        self.shares_base = shares_base  # whether the base weights are an engine's (`sharing_base`)
        self.lora_config = attach_lora(adapter, lora_config, name, seed)
        self.denoisers = self.adapter.denoisers
        if gradient_checkpointing:
            pipeline_class = type(self.adapter.pipeline).__name__
            families = "/".join(family.name for family in families_of(pipeline_class))
            enable_gradient_checkpointing(self.denoisers, f"{pipeline_class} (family {families})")

    sharded = False  # each rank holds the whole adapter: its forwards are its own
    saved_as = "lora"  # its folder in a run's output and checkpoints

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trainable LoRA parameters (what the optimizer updates)."""
        return [p for denoiser in self.denoisers.values() for p in denoiser.parameters() if p.requires_grad]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state, to checkpoint."""
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def sum_gradients(self, ranks) -> None:
        """Sum the LoRA's gradients over the data-parallel trainer `ranks` (before the optimizer step)."""
        ranks.sum_gradients(self.parameters())

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors in PEFT keys, detached copies: what `engine.load_lora` takes. Keys
        of a second denoiser carry its component name (`transformer_2.blocks...`)."""
        state = {}
        for index, (component, denoiser) in enumerate(self.denoisers.items()):
            prefix = "" if index == 0 else f"{component}."
            tensors = get_peft_model_state_dict(denoiser, adapter_name=self.name)
            state |= {prefix + key: tensor.detach().clone() for key, tensor in tensors.items()}
        return state

    def push(self, engine, version: int | None = None) -> int:
        """Hot-swap this adapter into the engine under its name; returns the new weight version (the
        engine's next one, or `version`: a resumed run continues its checkpoint's numbering)."""
        return engine.load_lora(self.name, self.lora_state(), self.lora_config, version=version)

    def load_base_weights(self, named_tensors: Mapping[str, torch.Tensor], component: str = DEFAULT_COMPONENT) -> None:
        """Take the base weights the engine took with `engine.update_weights(named_tensors,
        component=...)`, so the policy re-scores with the model that sampled. Checked as the
        engine checks them (names, shapes, dtypes); a bad set is refused whole. A policy that
        shares the engine's base (`sharing_base`) has them already: refused."""
        if self.shares_base:
            raise ValueError(
                "this policy shares the engine's base weights (LoraPolicy.sharing_base): engine.update_weights "
                "changed them for both; call only engine.update_weights"
            )
        module = self.adapter.components[component]
        problems = update_problems(specs_of(module), named_tensors.items(), check_finite=True)
        if problems:
            raise ValueError(
                f"base weights refused, policy unchanged: {len(problems)} problem(s) in {component}:\n  "
                + "\n  ".join(problems)
            )
        state = base_state(module)
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                state[name].copy_(tensor)

    def weights_checksum(self, component: str = DEFAULT_COMPONENT) -> str:
        """The digest `engine.weights_checksum(component)` gives for the same base weights."""
        return checksum(base_state(self.adapter.components[component]))

    def check_same_base(self, engine) -> None:
        """Raise ValueError unless `engine` (in process or a server's client) holds exactly this
        policy's base weights on every denoiser, compared by `weights_checksum`. A policy loaded
        from another model folder than the engine's (or in another dtype) re-scores samples of
        another model: call this when a run starts, before the first rollout. It hashes every
        denoiser weight on both sides (seconds for a billion parameters)."""
        differ = {
            component: (engine.weights_checksum(component), self.weights_checksum(component))
            for component in self.denoisers
        }
        differ = {component: pair for component, pair in differ.items() if pair[0] != pair[1]}
        if differ:
            digests = ", ".join(f"{c}: engine {e[:12]}, policy {p[:12]}" for c, (e, p) in differ.items())
            dtype = str(self.adapter.dtype).removeprefix("torch.")
            raise ValueError(
                f"the engine's base weights are not this policy's ({digests}): the policy loaded {self.model!r} in "
                f"{dtype}, the engine {engine.config.model!r} in {engine.config.dtype}. Load both from the same "
                "model folder in the same dtype; after engine.update_weights(tensors), give the policy the same "
                "with policy.load_base_weights(tensors)"
            )

    def save(self, folder: str | Path) -> Path:
        """Write the adapter as diffusers writes LoRAs (`pytorch_lora_weights.safetensors`, PEFT
        key names under `transformer.`, the LoRA config in the file's metadata), which the
        pipeline's `load_lora_weights(folder)` and `engine.load_lora(name, folder)` both accept.
        Wan 2.2's low-noise expert gets a file of its own, as diffusers loads it
        (`load_lora_weights(folder, weight_name=DIFFUSERS_LORA_FILE_2, load_into_transformer_2=True)`)."""
        pipeline_class = type(self.adapter.pipeline)
        if not issubclass(pipeline_class, LoraBaseMixin):
            # HunyuanVideo 1.5's pipelines have no LoRA loader; HunyuanVideo's writes a transformer's
            # LoRA in the same format (diffusers' file, `transformer.` keys), which the engine loads.
            from diffusers.loaders import HunyuanVideoLoraLoaderMixin as pipeline_class
        config = json.loads(json.dumps(self.lora_config.to_dict(), default=sorted))  # sets -> lists
        files = {"transformer": DIFFUSERS_LORA_FILE, "transformer_2": DIFFUSERS_LORA_FILE_2}
        for component, denoiser in self.denoisers.items():
            tensors = get_peft_model_state_dict(denoiser, adapter_name=self.name)
            pipeline_class.save_lora_weights(
                folder,
                transformer_lora_layers={key: tensor.detach().clone() for key, tensor in tensors.items()},
                transformer_lora_adapter_metadata=config,
                weight_name=files[component],
            )
        return Path(folder) / DIFFUSERS_LORA_FILE

    def load(self, folder: str | Path) -> None:
        """Set the adapter to the one `save` wrote to `folder`, exactly (float32 tensors, bitwise).

        The folder's LoRA config (read from the file's metadata) must match this policy's in every
        setting that changes what the adapter computes, and its tensors must be exactly this
        adapter's keys and shapes; otherwise ValueError naming what differs, and the policy is
        unchanged."""
        tensors, config = read_lora_folder(folder)
        if config is None:
            raise ValueError(
                f"LoRA folder {str(folder)!r} has no LoRA config in its metadata; LoraPolicy.load reads "
                "folders that LoraPolicy.save wrote (it needs the config to check rank and alpha)"
            )
        problems = _config_differences(self.lora_config, config)
        parameters = self._lora_parameters()
        first = next(iter(self.denoisers))
        loaded = {
            ("" if component == first else f"{component}.") + key: tensor
            for component, part in split_by_component(tensors, list(self.denoisers)).items()
            for key, tensor in part.items()
        }
        problems += tensor_differences(parameters, loaded)
        if problems:
            raise ValueError(
                f"LoRA folder {str(folder)!r} does not fit this policy (left unchanged): "
                + "; ".join(problems[:8])
                + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
                + ". Load a folder saved by a policy with the same lora config and model"
            )
        with torch.no_grad():
            for key, parameter in parameters.items():
                parameter.copy_(loaded[key])

    def _lora_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The trainable LoRA parameters under the keys `lora_state` gives their tensors."""
        parameters = {}
        for index, (component, denoiser) in enumerate(self.denoisers.items()):
            prefix = "" if index == 0 else f"{component}."
            for name, parameter in denoiser.named_parameters():
                if parameter.requires_grad:
                    parameters[prefix + name.replace(f".{self.name}.", ".")] = parameter
        return parameters

    @contextlib.contextmanager
    def holding(self, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Inside this block the adapter holds `state` (an earlier `lora_state()` of this policy:
        the adapter that sampled a stale rollout) and the model runs without gradients; on exit
        the trained tensors are back, bitwise. The values are swapped in place, so the optimizer's
        parameters, a compiled model's graphs and the other adapters are untouched. A state of
        other keys or shapes raises ValueError before anything changes."""
        parameters = self._lora_parameters()
        problems = tensor_differences(parameters, state)
        if problems:
            raise ValueError(
                f"the adapter state does not fit policy {self.name!r}: {'; '.join(problems[:6])}; "
                "pass a lora_state() of this policy"
            )
        with torch.no_grad():
            own = {key: parameter.detach().clone() for key, parameter in parameters.items()}
            try:
                for key, parameter in parameters.items():
                    parameter.copy_(state[key])
                yield
            finally:
                for key, parameter in parameters.items():
                    parameter.copy_(own[key])

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Inside this block the model is the frozen reference (the base, LoRA disabled) and runs
        without gradients."""
        for denoiser in self.denoisers.values():
            denoiser.disable_lora()
        try:
            with torch.no_grad():
                yield
        finally:
            for denoiser in self.denoisers.values():
                denoiser.enable_lora()

    def score(self, trajectories: Sequence[Trajectory], steps: int | Sequence[int]) -> StepOutput:
        """Re-score step `steps[i]` of trajectory i (one int: that step of each) in one batched
        forward, with gradients through the LoRA. Under `with policy.reference():` the same call
        scores under the reference policy.

        The trajectories must share image size, sampler, noise level, log-prob form and guidance
        (one rollout call's do when its requests share them); each step must be one of its
        trajectory's `scorable_steps` (else `NoDensityError`, before any forward)."""
        if isinstance(steps, int):
            steps = [steps] * len(trajectories)
        check_scorable(trajectories, steps)
        _check_shared_settings(trajectories)
        with self._at_scale(trajectories[0].lora_scale):
            return score_steps(self.adapter, trajectories, steps)

    @contextlib.contextmanager
    def _at_scale(self, scale: float | None) -> Iterator[None]:
        """The adapter at `scale` (a trajectory's `lora_scale`, as the engine ran it: PEFT's scaling
        times `scale`); None (a base-model sample) or 1: at full strength. The forward keeps the
        scale it ran with for the backward, so the scale goes back at once."""
        if scale is None or scale == 1:
            yield
            return
        for denoiser in self.denoisers.values():
            denoiser.set_adapters([self.name], [scale])
        try:
            yield
        finally:
            for denoiser in self.denoisers.values():
                denoiser.set_adapters([self.name])

    def predict_velocity(
        self, latents: torch.Tensor, sigmas: torch.Tensor, trajectories: Sequence[Trajectory]
    ) -> torch.Tensor:
        """The conditional velocity [B, *latent_shape] float32 of each trajectory's prompt, without
        classifier-free guidance (a guidance-distilled model still gets its guidance input), as
        DPO's flow-matching loss uses it; under `with policy.reference():` the reference's."""
        first = trajectories[0]
        conditions = [Condition(t.condition.prompt) for t in trajectories]
        guidance = Guidance(guidance_scale=first.guidance_scale)  # without CFG, only a distilled model's input
        return self.adapter.predict_velocity(
            latents, sigmas, conditions, height=first.height, width=first.width, guidance=guidance
        )


# The LoRA settings that change what an adapter computes (or how it trains, for dropout).
_LOADED_CONFIG_FIELDS = (
    "r",
    "lora_alpha",
    "target_modules",
    "exclude_modules",
    "lora_dropout",
    "bias",
    "use_rslora",
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
)


def _config_differences(expected: LoraConfig, found: LoraConfig) -> list[str]:
    def plain(value):  # target modules are a set in one config and a list in the other
        return sorted(value) if isinstance(value, set | list | tuple) else value

    return [
        f"lora config {name} is {plain(getattr(found, name))!r}, the policy's is {plain(getattr(expected, name))!r}"
        for name in _LOADED_CONFIG_FIELDS
        if plain(getattr(found, name)) != plain(getattr(expected, name))
    ]


def tensor_differences(parameters: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor]) -> list[str]:
    """How `loaded` (a checkpoint's tensors) differs from `parameters`: missing or unexpected keys,
    other shapes or dtypes."""
    problems = [f"missing tensor {key}" for key in parameters if key not in loaded]
    problems += [f"unexpected tensor {key}" for key in loaded if key not in parameters]
    problems += [
        f"{key} has shape {list(loaded[key].shape)} {loaded[key].dtype}, expected {list(p.shape)} {p.dtype}"
        for key, p in parameters.items()
        if key in loaded and (loaded[key].shape != p.shape or loaded[key].dtype != p.dtype)
    ]
    return problems


def _check_shared_settings(trajectories: Sequence[Trajectory]) -> None:
    """One batched re-score applies the first trajectory's settings to every transition: refuse a
    batch where another's differ (it would be scored under settings it was not sampled with)."""
    first = trajectories[0]
    differ = [
        f"{name} ({getattr(first, name)!r} vs {getattr(t, name)!r} in trajectory {number})"
        for name in TRAJECTORY_SETTINGS
        for number, t in enumerate(trajectories)
        if getattr(t, name) != getattr(first, name)
    ]
    if differ:
        raise ValueError(
            "policy.score batches transitions that share their sampling settings, but these differ: "
            + "; ".join(dict.fromkeys(differ[:4]))
            + "; score each kind in its own call"
        )
