"""Find, check and load a local diffusers pipeline folder into the adapter of its model family.

The pipeline class (`_class_name` in model_index.json) picks the adapter, as the family
descriptors in `rollout.pipelines.families` register it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rollout.config import COMPILE_CHOICES, compiled_attention_refusal
from rollout.pipelines.attention import backend_refusal, set_attention_backend
from rollout.pipelines.compiled_blocks import compile_blocks
from rollout.pipelines.families import adapters_by_pipeline
from rollout.pipelines.model_index import read_model_index
from rollout.pipelines.quiet import quietly

logger = logging.getLogger(__name__)

ADAPTERS = adapters_by_pipeline()


def adapter_class(pipeline_class: str) -> type:
    return ADAPTERS[pipeline_class]


@quietly
def load_adapter(
    path: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str | None = None,
    compile: str = "off",
):
    """Load the pipeline with diffusers' `from_pretrained` (local files only) and wrap it in its
    family's `PipelineAdapter`. Its weights load frozen (`requires_grad` False), as the engine runs
    them: a trainer turns on what it trains (`LoraPolicy` its adapter; a full fine-tune
    `adapter.transformer.requires_grad_(True)`). Gradients still flow to `predict_velocity`'s inputs.

    `attention_backend`: the diffusers attention dispatcher name every denoiser's attention runs
    with (`EngineConfig.attention_backend`; a trainer re-scores with the engine's); None keeps
    diffusers' default. One that cannot run on `device` in `dtype` is a ValueError naming those that can.

    `compile`: `EngineConfig.compile`'s choices; "blocks" compiles the repeated transformer blocks
    of every denoiser (`rollout.pipelines.compiled_blocks`), as an engine with that setting does, so
    a trainer re-scores a compiled rollout with the same computation."""
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {compile!r}")
    refusal = compiled_attention_refusal(compile, attention_backend)
    if refusal is not None:
        raise ValueError(refusal)
    if attention_backend is not None:
        refusal = backend_refusal(attention_backend, device, dtype, probe=True)
        if refusal is not None:
            raise ValueError(refusal)
    index = read_model_index(path)
    adapter = adapter_class(index["_class_name"]).load(path, index, device, dtype)
    if attention_backend is not None:
        set_attention_backend(adapter.denoisers, attention_backend)
    logger.info("loaded %s from %s on %s (%s)", index["_class_name"], path, device, dtype)
    if compile == "blocks":
        compile_blocks(adapter.denoisers)
    return adapter
