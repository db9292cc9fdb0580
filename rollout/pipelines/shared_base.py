"""A second adapter of a loaded pipeline whose denoisers are module trees of their own over the
first one's weights: what a colocated trainer re-scores with, at the cost of its LoRA alone.

Each denoiser is built again from its config on the meta device (no memory), and then every
parameter, buffer and tensor attribute of it is pointed at the storage of the loaded denoiser's.
The trees are separate, so a LoRA added to one (the trainer's PEFT adapter, the engine's
`LoraManager` layers) is not in the other; the parameters are separate objects over one storage,
so what rebinds a weight of one tree (a merged LoRA: `weight.data = merged`, which
`rollout.lora.merge` does out of place; a weight swap) leaves the other's as it was. Whoever swaps
the weights of the first keeps the second in step (`rollout.weights.state.StagedUpdates.share`).
"""

from __future__ import annotations

import copy

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from rollout.pipelines.adapter import PipelineAdapter
from rollout.pipelines.attention import set_attention_backend
from rollout.pipelines.compiled_blocks import compile_blocks


def sharing_adapter(adapter: PipelineAdapter, attention_backend: str | None, compile: str) -> PipelineAdapter:
    """An adapter of `adapter`'s family whose denoisers are new module trees sharing the base
    weights of `adapter`'s (every tensor's storage), with attention dispatched to
    `attention_backend` and `compile` ("blocks" or "off") as the engine set them on its own. Its
    other components (text encoders, VAE) are `adapter`'s own modules, not copies: nothing loads.
    Its spec is `adapter`'s. Call it while no LoRA is merged into `adapter`'s weights."""
    pipeline = copy.copy(adapter.pipeline)  # its own attributes; the same component objects
    for component, denoiser in adapter.denoisers.items():
        setattr(pipeline, component, denoiser_sharing_base(denoiser))
    shared = type(adapter)(pipeline)
    shared.spec = adapter.spec  # with the folder's sampling defaults, as loading set them
    if attention_backend is not None:
        set_attention_backend(shared.denoisers, attention_backend)
    if compile == "blocks":
        compile_blocks(shared.denoisers)
    return shared


def denoiser_sharing_base(model: nn.Module) -> nn.Module:
    """A new `type(model)` from `model.config` whose every parameter (a frozen `nn.Parameter` of
    its own), buffer and tensor attribute is `model`'s storage. LoRA layers of `model` (PEFT's,
    `.base_layer` wrappers) are left out: the new tree is the plain architecture."""
    with torch.device("meta"):
        twin = type(model).from_config(model.config)
    twin.requires_grad_(False)
    twin.train(model.training)  # `from_config` builds in training mode, `from_pretrained` loads in eval mode
    for name, source in model.named_modules():
        parts = name.split(".")
        if isinstance(source, BaseTunerLayer) or any(part.startswith("lora_") for part in parts):
            continue  # PEFT's wrappers and LoRA layers; a wrapper's weights are its `base_layer`'s
        target = twin.get_submodule(".".join(part for part in parts if part != "base_layer"))
        if type(target) is not type(source):
            raise RuntimeError(f"{name}: {type(source).__name__} in the loaded model, {type(target).__name__} built")
        for leaf, parameter in source._parameters.items():
            if parameter is not None:
                target._parameters[leaf] = nn.Parameter(parameter.data, requires_grad=False)
        for leaf, buffer in source._buffers.items():
            target._buffers[leaf] = buffer
        for attribute, value in vars(source).items():
            if _tensor_attribute(value):  # kept outside the buffers: a rope table, Qwen-Image 2.1's list of them
                setattr(target, attribute, value)
    left = [name for name, tensor in _tensors(twin) if tensor.is_meta]
    if left:
        raise RuntimeError(
            f"{type(model).__name__} keeps tensors the sharing cannot point at the loaded model's: {left[:3]}; "
            "load the trainer's own copy (LoraPolicy(model, ...)) for this model"
        )
    return twin


def _tensor_attribute(value) -> bool:
    """Whether a module's plain attribute `value` holds tensors: a tensor, or a list or tuple of them."""
    if isinstance(value, list | tuple):
        return bool(value) and all(isinstance(item, torch.Tensor) for item in value)
    return isinstance(value, torch.Tensor)


def _tensors(model: nn.Module):
    """(name, tensor) of every parameter, buffer and tensor attribute (or list of them) of `model`."""
    for module_name, module in model.named_modules():
        for leaf, value in [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]:
            if isinstance(value, torch.Tensor):
                yield f"{module_name}.{leaf}", value
            elif _tensor_attribute(value):
                yield from ((f"{module_name}.{leaf}.{index}", tensor) for index, tensor in enumerate(value))
