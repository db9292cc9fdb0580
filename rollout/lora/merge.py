"""One LoRA adapter merged into a model's base weights for rollouts, and the exact way back.

An unmerged PEFT adapter adds two low-rank matmuls to every targeted layer of every forward; when
every row of a forward uses the same adapter at the same scale, the forward can run the merged
weights `W + scale * scaling * B @ A` instead, at the base model's cost.

Merging never writes into a base weight: each merged weight is a new tensor that the layer's
`weight` points at (`parameter.data = merged`), and the base tensor itself is kept aside untouched.
Restoring points the layer back at it, so any number of merge/restore cycles leaves the base
bitwise as it was (PEFT's own `unmerge` subtracts the delta again, which rounds). The cost is the
memory of one more copy of the targeted weights while merged; restoring frees it.

Only plain LoRA on `nn.Linear` layers merges (PEFT's `lora.Linear`; PEFT turns `fan_in_fan_out`
off on those, it is for GPT-2's `Conv1D`). An adapter with any other layer (DoRA and other variants, a LoRA bias, a
convolution or an embedding) is refused by `merge_problems`, and the caller keeps it unmerged.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn


def merge_problems(model: nn.Module, layers: str) -> list[str]:
    """Why PEFT adapter `layers` of `model` cannot be merged exactly, one line per kind of layer
    (at most 3 names each); [] when every one of its layers is a plain LoRA on an `nn.Linear`."""
    problems: dict[str, list[str]] = {}
    for module_name, module in model.named_modules():
        if not (isinstance(module, LoraLayer) and layers in module.lora_A):
            continue
        if not isinstance(module, LoraLinear) or not isinstance(module.get_base_layer(), nn.Linear):
            why = f"{type(module.get_base_layer()).__name__} layers (only nn.Linear merges)"
        elif layers in module.lora_variant:
            why = f"{type(module.lora_variant[layers]).__name__} layers (DoRA and other variants do not merge)"
        elif module.lora_bias.get(layers, False):
            why = "layers with a LoRA bias"
        else:
            continue
        problems.setdefault(why, []).append(module_name)
    return [f"{why}: {', '.join(names[:3])}" for why, names in problems.items()]


class MergedLora:
    """Adapter `layers` of `model` at `scale`, merged into the base weights of its layers until
    `restore`. The caller disables the model's LoRA layers while merged (else they would add their
    delta a second time) and checks `merge_problems` first.

    Each merged weight is `(W.float() + delta).to(W.dtype)` with PEFT's delta for the layer,
    `scaling * B @ A`, computed in float32."""

    def __init__(self, model: nn.Module, layers: str, scale: float):
        self.layers = layers
        self.scale = scale
        self._pristine: list[tuple[nn.Parameter, torch.Tensor]] = []  # (the weight, its base tensor)
        try:
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, LoraLayer) and layers in module.lora_A:
                        self._merge_layer(module)
        except BaseException:
            self.restore()  # a merge that fails part-way leaves the base as it was
            raise

    def _merge_layer(self, layer: LoraLinear) -> None:
        weight = layer.get_base_layer().weight
        base = weight.data
        layer.set_scale(self.layers, self.scale)  # scaling = scale * lora_alpha / r (or / sqrt(r): rsLoRA)
        a = layer.lora_A[self.layers].weight.to(base.device, torch.float32)  # [r, in]
        b = layer.lora_B[self.layers].weight.to(base.device, torch.float32)  # [out, r]
        # PEFT's get_delta_weight (B @ A * scaling; on an nn.Linear PEFT turns fan_in_fan_out off)
        # added in one pass: 2.4x faster on a CPU. Out of place, so a float32 base (which
        # .to(float32) returns as it is) stays untouched too.
        merged = torch.addmm(base.to(torch.float32), b, a, alpha=layer.scaling[self.layers])
        weight.data = merged.to(base.dtype)
        self._pristine.append((weight, base))

    def restore(self) -> None:
        """Point every merged weight back at its base tensor (bitwise the one before the merge) and
        free the merged ones. Restoring twice does nothing."""
        for weight, base in self._pristine:
            weight.data = base
        self._pristine.clear()


def pristine_bytes(model: nn.Module, layers: str) -> int:
    """Bytes of the base weights adapter `layers` merges into: what merging it holds extra."""
    total = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and layers in module.lora_A:
            weight = module.get_base_layer().weight
            total += weight.numel() * weight.element_size()
    return total
