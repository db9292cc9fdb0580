"""What every family's tiny builder shares: one signature (`TinyBuilder`, given by `tiny_builder`)
and the benchmark presets as rows of sizes (`Preset`), so a family's `tiny.py` writes only what
its pipeline is made of.

A builder is deterministic in `seed`; a folder that already holds a pipeline is overwritten;
`transformer_config` replaces the tiny transformer (benchmarks pass a published config); the modules
are made on `device` and saved in `dtype`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rollout.pipelines.quiet import quietly
from rollout.pipelines.tiny.saving import InMemory


class TinyBuilder(Protocol):
    """`build(path, seed=0, sizes=<the family's tiny sizes>, transformer_config=None, device="cpu",
    dtype=torch.float32, **options) -> path`: a tiny pipeline of the real classes with random
    weights, saved to `path` (options: the family's own, e.g. SD3's `with_t5`)."""

    def __call__(
        self,
        path: str | Path,
        seed: int = 0,
        sizes: Any = ...,
        transformer_config: dict | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> Path: ...


def tiny_builder(default_sizes: Any) -> Callable[[Callable[..., Path]], TinyBuilder]:
    """Make `build(path, seed, sizes, transformer_config, device, dtype, **options) -> path` (every
    argument given, `path` a `Path`) a `TinyBuilder` whose sizes default to `default_sizes`, run
    quietly (no third-party progress bars)."""

    def decorate(build: Callable[..., Path]) -> TinyBuilder:
        @functools.wraps(build)
        def with_defaults(
            path: str | Path,
            seed: int = 0,
            sizes: Any = default_sizes,
            transformer_config: dict | None = None,
            device: str = "cpu",
            dtype: torch.dtype = torch.float32,
            **options: Any,
        ) -> Path:
            # An `InMemory` destination passes through: the pipeline is kept, not saved (saving.py).
            destination = path if isinstance(path, InMemory) else Path(path)
            return build(destination, seed, sizes, transformer_config, device, dtype, **options)

        del with_defaults.__wrapped__  # its signature is the one above, with the defaults
        return quietly(with_defaults)

    return decorate


def published_config(module_file: str, name: str) -> dict:
    """The transformer config `name` kept beside a family's tiny.py (`module_file`): a published
    model's config.json as its repository has it, which a "real" preset builds with random weights."""
    return json.loads((Path(module_file).parent / name).read_text())


# A VAE with 4 blocks scales by 8, as the real ones do; narrow, so decoding stays cheap.
REAL_VAE_BLOCKS = (16, 16, 16, 16)
# The parts of a "small" preset's sizes: a transformer big enough to dominate a CPU's time (4 layers of
# 4 x 32 heads) beside the tiny text encoders and VAE.
SMALL_PARTS = {"num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 32}
# The parts of a "real" preset's sizes that are not its published transformer: one-layer text
# encoders, a narrow VAE with the real scale factor, and the published pipeline's default size.
REAL_PARTS = {"text_layers": 1, "vae_block_out_channels": REAL_VAE_BLOCKS, "sampling_defaults": None}


def block_sizes(sizes: Any) -> dict:
    """The block sizes most tiny transformers take under these names (`SMALL_PARTS`' fields):
    `num_layers` blocks of `num_attention_heads` heads of `attention_head_dim`."""
    return {name: getattr(sizes, name) for name in SMALL_PARTS}


def small_sizes(sizes_class: type, **fields: Any) -> Any:
    """`sizes_class(**fields)` with the `SMALL_PARTS` the class has (and `fields` does not set)."""
    return _with_parts(sizes_class, SMALL_PARTS, fields)


def real_sizes(sizes_class: type, **fields: Any) -> Any:
    """`sizes_class(**fields)` with the `REAL_PARTS` the class has (and `fields` does not set)."""
    return _with_parts(sizes_class, REAL_PARTS, fields)


def _with_parts(sizes_class: type, parts: dict, fields: dict) -> Any:
    known = sizes_class.__dataclass_fields__
    return sizes_class(**{name: value for name, value in parts.items() if name in known} | fields)


@dataclass(frozen=True)
class Preset:
    """A benchmark preset (benchmarks/model_presets.py): `builder` at `sizes` (None: its tiny ones),
    with `transformer_config` in place of the tiny transformer (None: the one `sizes` makes).
    Called as the family's presets are, `preset(folder, device="cpu", dtype=torch.float32) -> folder`."""

    builder: TinyBuilder
    sizes: Any = None
    transformer_config: dict | None = None

    def __call__(self, folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Path:
        sizes = {} if self.sizes is None else {"sizes": self.sizes}
        return self.builder(folder, transformer_config=self.transformer_config, device=device, dtype=dtype, **sizes)
