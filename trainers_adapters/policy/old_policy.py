"""The old policy of a decoupled algorithm (DiffusionNFT): a second, frozen LoRA adapter on the
trainer's model that the engine samples with while the trainer moves the current one, and that
follows the current adapter as an exponential moving average after each rollout's update.

DiffusionNFT (Zheng et al., arXiv 2509.16117; the authors' scripts/train_nft_sd3.py) starts the old
adapter as a copy of the current one and, after each rollout's optimizer steps, sets
old <- old * decay + current * (1 - decay), with a decay that grows with the number of optimizer
steps taken: 0 for the first `flat_steps`, then `rate` per step, capped at `max_decay`
(`DecaySchedule`). Decay 0 makes the old policy the current one (on-policy).

The old adapter sits on the same denoisers as the policy's (one copy of the base weights): its
velocity is the same forward pass with the other adapter active.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from rollout.lora.manager import adapter_to_float32
from trainers_adapters.policy.lora_policy import LoraPolicy, tensor_differences

ADAPTER_FILE = "old_adapter.safetensors"
STATE_FILE = "old_policy.json"


@dataclass(frozen=True)
class DecaySchedule:
    """The EMA decay after `step` optimizer steps: 0 while step < flat_steps, then
    min((step - flat_steps) * rate, max_decay). The authors' decay_type 1 is (0, 0.001, 0.5), their
    decay_type 2 (0, 75 flat steps) is (75, 0.0075, 0.999), decay_type 0 is all zeros."""

    flat_steps: int = 0
    rate: float = 0.001
    max_decay: float = 0.5

    def __call__(self, step: int) -> float:
        if step < self.flat_steps:
            return 0.0
        return min((step - self.flat_steps) * self.rate, self.max_decay)


def ema_update_(target: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor], decay: float) -> None:
    """In place, for every key: target <- target * decay + source * (1 - decay). Both mappings
    must hold the same keys and shapes (ValueError naming the differences; nothing changes)."""
    problems = [f"missing {key}" for key in target if key not in source]
    problems += [f"unexpected {key}" for key in source if key not in target]
    problems += [
        f"{key}: {list(source[key].shape)} vs {list(tensor.shape)}"
        for key, tensor in target.items()
        if key in source and source[key].shape != tensor.shape
    ]
    if problems:
        raise ValueError(f"EMA update refused, target unchanged: {'; '.join(problems[:6])}")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
    with torch.no_grad():
        for key, tensor in target.items():
            tensor.copy_(tensor * decay + source[key] * (1.0 - decay))


class OldPolicy:
    """A frozen copy, named `name`, of `policy`'s adapter on the same denoisers. `optimizer_steps`
    counts the policy's optimizer steps that the EMA schedule has seen (checkpointed with it)."""

    def __init__(self, policy: LoraPolicy, name: str = "old"):
        if name == policy.name:
            raise ValueError(f"the old policy's adapter needs a name of its own, not the policy's {name!r}")
        self.policy = policy
        self.name = name
        self.optimizer_steps = 0
        for denoiser in policy.denoisers.values():
            with warnings.catch_warnings():  # PEFT warns on every second adapter; a second one is the point
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                denoiser.add_adapter(policy.lora_config, adapter_name=name)
            adapter_to_float32(denoiser, name)
            denoiser.set_adapters([policy.name])  # also makes only the policy's adapter trainable
        self._freeze()
        ema_update_(self.tensors(), self.policy_tensors(), 0.0)  # start as a copy

    def tensors(self) -> dict[str, torch.Tensor]:
        """The old adapter's parameters (live, frozen) under the keys `policy_tensors` uses."""
        return self._adapter_parameters(self.name)

    def policy_tensors(self) -> dict[str, torch.Tensor]:
        """The current adapter's parameters (live) under the same keys."""
        return self._adapter_parameters(self.policy.name)

    def step(self, optimizer_steps: int, schedule: DecaySchedule) -> float:
        """After the policy took `optimizer_steps` more optimizer steps: advance the clock and move
        the old adapter towards the current one with the schedule's decay there; returns the decay."""
        self.optimizer_steps += optimizer_steps
        decay = schedule(self.optimizer_steps)
        ema_update_(self.tensors(), self.policy_tensors(), decay)
        return decay

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside this block the model computes with the old adapter, without gradients."""
        for denoiser in self.policy.denoisers.values():
            denoiser.set_adapters([self.name])
        try:
            with torch.no_grad():
                yield
        finally:
            for denoiser in self.policy.denoisers.values():
                denoiser.set_adapters([self.policy.name])
            self._freeze()

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The old adapter's tensors in PEFT keys (detached copies), as `engine.load_lora` takes them."""
        state = {}
        for index, (component, denoiser) in enumerate(self.policy.denoisers.items()):
            prefix = "" if index == 0 else f"{component}."
            tensors = get_peft_model_state_dict(denoiser, adapter_name=self.name)
            state |= {prefix + key: tensor.detach().clone() for key, tensor in tensors.items()}
        return state

    def push(self, engine, version: int | None = None) -> int:
        """Hot-swap the old adapter into the engine under its name; returns the new weight version."""
        return engine.load_lora(self.name, self.lora_state(), self.policy.lora_config, version=version)

    def save(self, folder: str | Path) -> None:
        """Write the old adapter (float32, exactly) and its EMA clock to `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({key: t.detach().contiguous() for key, t in self.tensors().items()}, folder / ADAPTER_FILE)
        (folder / STATE_FILE).write_text(json.dumps({"name": self.name, "optimizer_steps": self.optimizer_steps}))

    def load(self, folder: str | Path) -> None:
        """Set the old adapter and its clock to what `save` wrote to `folder`, bitwise; a folder
        that does not fit (other keys or shapes) raises ValueError and changes nothing."""
        folder = Path(folder)
        loaded = load_file(folder / ADAPTER_FILE)
        state = json.loads((folder / STATE_FILE).read_text())
        tensors = self.tensors()
        problems = tensor_differences(tensors, loaded)
        if problems:
            raise ValueError(
                f"old policy in {str(folder)!r} does not fit this policy (left unchanged): {'; '.join(problems[:6])}"
            )
        with torch.no_grad():
            for key, tensor in tensors.items():
                tensor.copy_(loaded[key])
        self.optimizer_steps = int(state["optimizer_steps"])

    def _adapter_parameters(self, adapter: str) -> dict[str, torch.nn.Parameter]:
        parameters = {}
        for index, (component, denoiser) in enumerate(self.policy.denoisers.items()):
            prefix = "" if index == 0 else f"{component}."
            for name, parameter in denoiser.named_parameters():
                if f".{adapter}." in name:
                    parameters[prefix + name.replace(f".{adapter}.", ".")] = parameter
        return parameters

    def _freeze(self) -> None:
        # PEFT makes the active adapter trainable and the others frozen whenever adapters switch;
        # stated here once more so the optimizer's parameter list never sees the old adapter.
        for parameter in self.tensors().values():
            parameter.requires_grad_(False)
