"""Regional compilation of a denoiser (`EngineConfig.compile="blocks"`): each of its repeated
transformer blocks runs a `torch.compile`d forward; the rest of the model (embeddings, the final
norm and projection, the Python between the blocks) stays eager.

The blocks are the classes the model's diffusers class names in `_repeated_blocks`, the list that
diffusers' own `ModelMixin.compile_repeated_blocks` reads. SD3's `SD3Transformer2DModel` declares
none (diffusers 0.42), so a class without one falls back on its `_no_split_modules`, which names the
same kind of block (SD3's `JointTransformerBlock`) for accelerate's device maps.

Three choices, each for something else that must keep working:

- The block's `forward` is compiled, not its `__call__` (diffusers' `compile_repeated_blocks`
  calls `module.compile()`, which compiles `_call_impl` and with it the module's hooks). A
  forward pre-hook, such as the worker's progress count (`rollout.worker.progress`), stays eager
  outside the compiled region: a Python side effect inside it would break the graph, and an integer
  that changes on every call would be a guard that fails on every call. A block with hooked
  modules inside it (HunyuanVideo 1.5's `HunyuanVideo15TokenRefiner` holds its refiner blocks, each
  counting progress) is compiled through those modules instead: their forwards compile, their
  hooks and the block's own few lines around them stay eager. Compiled whole, its graph would hold
  the count and compile again at every call (measured: 6 graphs more for two repeated calls).
- The batch dimension is marked dynamic (`maybe_mark_dynamic` on dim 0 of every tensor argument
  with the hidden states' batch size), every other dimension stays static. The engine batches
  requests step by step, so any batch size from 1 to `max_batch_size` (twice that with SD3's CFG
  rows in one pass) reaches the blocks. Marked so, one graph serves every batch of 2 rows or more
  and torch specialises a batch of 1 in a second one (it always specialises sizes 0 and 1): two
  graphs per block kind, whatever order the sizes come in, measured across batches 1..16 on the
  tiny SD3. `dynamic=True` compiles the same two graphs but makes the token and channel
  dimensions symbolic too, which costs the GPU its shape-specialised kernels for no gain (one
  resolution per run is the common case; a new one compiles once and torch's automatic dynamic
  shapes make that dimension dynamic from then on). Padding to buckets would run padded rows
  through every block and still compile once per bucket.
- The weights are graph inputs, not constants: torch's default `inline_inbuilt_nn_modules` traces
  the module's parameters as inputs and guards on their shapes, dtypes and devices, not their
  values or storage. A weight push (`update_weights`), a LoRA adapter merged into the weights and
  restored (`rollout.lora.merge` points `weight.data` at another tensor of the same shape), the
  copy of a hot swap and sleep/wake (`rollout.worker.sleep`) reach the compiled graph without a
  recompile. What changes the module tree or the Python a block runs does recompile, once per
  kind: the first LoRA adapter (PEFT wraps the targeted layers), and with unmerged adapters
  (`merge_lora="never"`, or bfloat16 under "auto") each adapter name and scale PEFT's forward reads,
  and every adapter once more after a new name is loaded (PEFT's layers hold a dict of adapters).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)


def repeated_block_classes(model: nn.Module) -> tuple[str, ...]:
    """Class names of `model`'s repeated transformer blocks: its diffusers class's `_repeated_blocks`,
    else its `_no_split_modules` (SD3 declares only those); ValueError where it has neither."""
    names = tuple(getattr(type(model), "_repeated_blocks", None) or ())
    names = names or tuple(getattr(type(model), "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"compile='blocks' cannot tell the repeated blocks of {type(model).__name__}: its class declares "
            "neither _repeated_blocks nor _no_split_modules; run it with compile='off'"
        )
    return names


def compile_blocks(denoisers: Mapping[str, nn.Module]) -> int:
    """Compile the forward of every repeated block of each denoiser (component name -> model) in
    place; returns how many blocks. Compiling is lazy: the first forward of each block kind (and
    then of a batch of another kind of size, see the module docstring) traces and compiles it."""
    _raise_recompile_limit()
    total = 0
    for component, model in denoisers.items():
        classes = repeated_block_classes(model)
        named = [module for module in model.modules() if type(module).__name__ in classes]
        if not named:
            raise ValueError(
                f"compile='blocks' found no block of {type(model).__name__} ({component}) of the classes "
                f"{list(classes)} its diffusers class names; run it with compile='off'"
            )
        blocks = list({id(unit): unit for block in named for unit in _compiled_units(block)}.values())
        for block in blocks:
            # An instance attribute over the class's forward: `nn.Module.__call__` runs it, hooks and
            # all, as before. One compiled function per block; the graphs are cached on the class's
            # code and shared by every block of the class (and by both experts of Wan 2.2).
            block.forward = _batch_dynamic(torch.compile(block.forward))
        name = type(model).__name__
        logger.info("compiling %d %s blocks of %s (%s)", len(blocks), "/".join(classes), component, name)
        total += len(blocks)
    return total


def _compiled_units(block: nn.Module) -> list[nn.Module]:
    """What compiles for `block`: itself, or where modules inside it carry forward hooks, the
    outermost of those (see the module docstring), so that no hook runs inside a graph."""
    hooked: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if child._forward_pre_hooks or child._forward_hooks:
                hooked.append(child)
            else:
                visit(child)

    visit(block)
    return hooked or [block]


# Graphs torch keeps per block class before it runs further variants eagerly (dynamo's
# `recompile_limit`, 8 by default). SD3's two block variants (the last one is `context_pre_only`)
# share one class, so it fills the default's 8 with the batch-of-1 and any-batch graphs of its
# blocks before and after the first LoRA adapter (measured); each unmerged adapter (and scale) adds
# 4 more. Past the limit a block runs eagerly: the same numbers, slower, and torch warns once.
RECOMPILE_LIMIT = 32


def _raise_recompile_limit() -> None:
    """Lift dynamo's per-function recompile limit to `RECOMPILE_LIMIT` (never lower it). It is
    process-wide: a worker process is the engine's own, and in-process ('uni') it only lets
    compiled functions keep more graphs."""
    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        logger.info("raising torch._dynamo.config.recompile_limit to %d for compiled blocks", RECOMPILE_LIMIT)
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT


def _batch_dynamic(compiled: Callable) -> Callable:
    """`compiled` with the batch dimension of its tensor arguments marked dynamic: dim 0 of each
    tensor whose first size is the first tensor's (a block's hidden states come first)."""

    def forward(*args, **kwargs):
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor) and value.ndim]
        if tensors:
            batch = tensors[0].shape[0]
            for tensor in tensors:
                if tensor.shape[0] == batch:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return compiled(*args, **kwargs)

    return forward
