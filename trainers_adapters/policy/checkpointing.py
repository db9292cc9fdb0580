"""Gradient checkpointing of the trainer's denoisers (`LoraPolicy(gradient_checkpointing=True)`): a
forward with gradients keeps only each transformer block's inputs, and the backward runs the block
again to get the activations it needs. The same gradients (the same kernels on the same inputs,
bitwise on the CPU) for one more forward of the blocks, against every block's activations held
from the forward to the backward, which at a 12B or 14B model's sequence lengths is what fills a GPU.

It is diffusers' own: `ModelMixin.enable_gradient_checkpointing` marks the model's block loop, which
checkpoints each block while `torch.is_grad_enabled() and self.gradient_checkpointing` (diffusers
0.42; not `self.training`: the policy's denoisers stay in eval mode). So a policy's forward without
gradients (its `reference()`, `holding(...)`, the micro-batches re-scored under `torch.no_grad()`)
runs as before, and the engine's copy of the model is never touched. Every denoiser class of the
families in `rollout.pipelines.families` supports it (`_supports_gradient_checkpointing`, tested);
a class that does not is refused by name.

Two things this module adds to diffusers' default checkpoint function:

- The recomputation runs at the LoRA scale its forward ran at. `LoraPolicy` re-scores a rollout
  sampled at `lora_scale` s by setting PEFT's scaling to s for the forward and back to 1 right
  after it (`LoraPolicy._at_scale`); the backward comes later, and a plain recomputation would
  read scale 1 and give other gradients (measured: 1.4 relative error on the tiny SD3 at 0.5). The
  scales of every LoRA layer of the block are read when the forward runs and put back for the
  recomputation (torch's `context_fn`). The other adapter state (on or off, which adapter, the
  tensors `holding` swaps in) only changes under `torch.no_grad()`, where nothing is checkpointed.
- It composes with compiled blocks (`compile="blocks"`): the checkpoint wraps the block's
  `__call__`, eager, and the compiled `forward` runs inside it in the forward and again in the
  recomputation, the same graphs (no graph break or recompile; measured on the tiny SD3: the same
  gradients bitwise and a lower peak than compiled without checkpointing).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping

import diffusers
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.utils.checkpoint import checkpoint


def enable_gradient_checkpointing(denoisers: Mapping[str, nn.Module], owner: str) -> None:
    """Checkpoint the blocks of every denoiser (component name -> model) of `owner` (its pipeline
    class, for the error); ValueError naming each whose diffusers class cannot, before any changes."""
    refused = [
        f"{component} ({type(model).__name__})"
        for component, model in denoisers.items()
        if not type(model)._supports_gradient_checkpointing
    ]
    if refused:
        raise ValueError(
            f"gradient_checkpointing: the denoiser(s) {', '.join(refused)} of {owner} do not support gradient "
            f"checkpointing in diffusers {diffusers.__version__} (their class's _supports_gradient_checkpointing "
            "is False); set trainer.gradient_checkpointing false for this model"
        )
    for model in denoisers.values():
        model.enable_gradient_checkpointing(checkpoint_block)


def checkpoint_block(block: nn.Module, *args):
    """diffusers' `gradient_checkpointing_func`: `block(*args)` under torch's non-reentrant
    checkpoint (diffusers' default kind), recomputed at the LoRA scales of its forward."""
    return checkpoint(block.__call__, *args, use_reentrant=False, context_fn=functools.partial(_scales_now, block))


def _scales_now(block: nn.Module) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(nothing for the forward, the recomputation at the scales every LoRA layer of `block` has now)."""
    layers = [module for module in block.modules() if isinstance(module, LoraLayer)]
    return contextlib.nullcontext(), _at_scales(layers, [dict(layer.scaling) for layer in layers])


@contextlib.contextmanager
def _at_scales(layers: list[LoraLayer], scales: list[dict[str, float]]) -> Iterator[None]:
    before = [dict(layer.scaling) for layer in layers]
    for layer, scaling in zip(layers, scales, strict=True):
        layer.scaling.update(scaling)
    try:
        yield
    finally:
        for layer, scaling in zip(layers, before, strict=True):
            layer.scaling.update(scaling)
