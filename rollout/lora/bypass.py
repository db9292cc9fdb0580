"""PEFT LoRA layers that are off for a forward, out of its way: each one runs as its base layer.

Once an adapter is loaded, PEFT's `LoraLayer` wraps every layer it targets, and stays there while
the model runs the base (no adapter picked) or an adapter merged into the base weights
(`rollout.lora.merge`). Off, the wrapper still runs PEFT's Python on every call (the argument
checks, the disabled and merged flags) before it calls its base layer: +60% on the call of a small
`nn.Linear` on a CPU (~4-5 us over ~7-9 us, load 2.6-5.6), on each of the 243 wrapped layers of an
SD3.5 Medium forward with the default targets (342 in FLUX.1's). A GPU waits on that Python.

Bypassing points each wrapper's `forward` at its base layer's own (an instance attribute over the
class's method), so a call costs what the plain layer's does and computes bitwise the same (PEFT
off calls exactly that). The module tree stays PEFT's: names, state dicts, the adapters' tensors
and PEFT's own calls see what they saw before. Only the forward changes, so the caller puts the
wrappers back before it turns any LoRA layer on (`enable_lora`, `set_adapters` do not see a bypass).
"""

from __future__ import annotations

from peft.tuners.lora import LoraLayer
from torch import nn


class BypassedLoraLayers:
    """Every PEFT LoRA layer of `model` running as its base layer until `put_back`. The caller
    bypasses only a model whose LoRA layers are all off (disabled, or merged into the base)."""

    def __init__(self, model: nn.Module):
        self._layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
        for layer in self._layers:
            # The base layer's forward, not its __call__: the wrapper's own __call__ already ran its
            # hooks, as a plain layer's does (one call deep, as in the model without adapters).
            layer.forward = layer.get_base_layer().forward

    def put_back(self) -> None:
        """Every layer runs PEFT's forward again. Putting back twice does nothing."""
        for layer in self._layers:
            del layer.forward  # the instance attribute: the class's forward shows through again
        self._layers.clear()
