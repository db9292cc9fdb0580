"""Sleep and wake: free a worker's weight memory for a colocated trainer, and get it back.

Level 1 keeps one packed copy of every weight in host memory (pinned when the weights live on a
GPU) and frees the modules' own storage; waking copies them back. Level 2 keeps nothing; waking
reloads the weights saved in the model folder. LoRA adapter tensors are small and stay put.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rollout.pipelines.quiet import quiet_third_party
from rollout.weights.state import TensorSpec, WeightSwap, base_state

logger = logging.getLogger(__name__)


@dataclass
class _Packed:
    buffer: torch.Tensor | None  # uint8, host memory; None at level 2
    layout: dict[str, tuple[int, TensorSpec, torch.device]]  # name -> (offset, spec, home device)


class Sleeper:
    def __init__(self, components: Mapping[str, nn.Module], model_folder: str):
        self.components = components
        self.model_folder = Path(model_folder)
        self.level = 0
        self._packed: dict[str, _Packed] = {}

    def sleep(self, level: int) -> None:
        """Go to `level` (1 or 2); asking for a level not deeper than the current one does nothing."""
        if level <= self.level:
            return
        for component, module in self.components.items():
            if self.level == 0:
                self._packed[component] = self._release(module, keep=level == 1)
            else:  # 1 -> 2: drop the host copy too
                self._packed[component].buffer = None
        self.level = level
        logger.info("worker asleep at level %d", level)

    def wake_up(self) -> None:
        if self.level == 0:
            return
        for component, module in self.components.items():
            packed = self._packed.pop(component)
            if packed.buffer is not None:
                restored = {
                    name: packed.buffer[offset : offset + spec.nbytes].view(spec.dtype).reshape(spec.shape).to(device)
                    for name, (offset, spec, device) in packed.layout.items()
                }
            else:
                restored = self._load_from_disk(component, module, packed)
            WeightSwap(module, restored).commit()
        logger.info("worker awake (was at level %d)", self.level)
        self.level = 0

    @staticmethod
    def _release(module: nn.Module, keep: bool) -> _Packed:
        state = base_state(module)
        layout, size = {}, 0
        for name, tensor in state.items():
            layout[name] = (size, TensorSpec(tuple(tensor.shape), tensor.dtype), tensor.device)
            size += layout[name][1].nbytes
        buffer = None
        if keep:
            on_gpu = any(t.device.type == "cuda" for t in state.values())
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=on_gpu)
            for name, tensor in state.items():
                offset, spec, _ = layout[name]
                _view(buffer, offset, spec).copy_(tensor.detach())
        empty = {name: torch.empty(0, dtype=t.dtype, device=t.device) for name, t in state.items()}
        WeightSwap(module, empty).commit()
        return _Packed(buffer, layout)

    def _load_from_disk(self, component: str, module: nn.Module, packed: _Packed) -> dict[str, torch.Tensor]:
        """The component's weights as its own class's `from_pretrained` reads them from the model
        folder (so renamed checkpoint keys and tied weights load as they did at start-up)."""
        folder = self.model_folder / component
        with quiet_third_party():
            fresh = base_state(type(module).from_pretrained(folder, dtype=module.dtype, local_files_only=True))
        missing = sorted(set(packed.layout) - set(fresh))
        if missing:
            raise RuntimeError(f"cannot wake up {component}: {folder} lacks {missing[:3]}")
        return {
            name: fresh[name].detach().to(device=device, dtype=spec.dtype)
            for name, (_, spec, device) in packed.layout.items()
        }


def _view(buffer: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """The tensor of `spec` stored at `offset` in a uint8 buffer."""
    return buffer[offset : offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)
