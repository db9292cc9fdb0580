"""Tiny pipelines of every supported family, of the real diffusers/transformers classes, with
random weights.

Tests, demos and benchmarks cannot download weights, so they build a pipeline here, save it with
`save_pretrained`, and load it back with the real `from_pretrained` code; every folder loads with
plain `PipelineClass.from_pretrained(path)`. Each family's builder is its folder's `tiny.py`
(`rollout/pipelines/families/<folder>/tiny.py`); this package holds what they share and hands
their builders out by name. Tokenizers are written locally (`tokenizers.py`), and the VAE decoders
are set close to a colour map (`colour.py`), so an image's colours follow its latents and the
demos' colour reward is something a policy can learn.

    python -m rollout.pipelines.tiny OUT_DIR [--family NAME] [--seed N]   (--help lists the families)
"""

from __future__ import annotations

import argparse
import importlib
import logging

from rollout.pipelines.families import FAMILIES, families_help

# Family name -> builder(path, seed=0) -> path, from the family descriptors.
TINY_BUILDERS = {family.name: family.build_tiny for family in FAMILIES}
# The families' tiny modules (`rollout/pipelines/families/<folder>/tiny.py`), whose builders and
# sizes (`build_tiny_sd3`, `TinySD3Sizes`) this package hands out by name.
TINY_MODULES = tuple(dict.fromkeys(family.tiny_builder.rpartition(".")[0] for family in FAMILIES))

__all__ = ["TINY_BUILDERS", "TINY_MODULES", "main"]


def __getattr__(name: str):
    """A family's tiny builder or sizes (`from rollout.pipelines.tiny import build_tiny_sd3`), from
    its folder's tiny module, imported when first named: those modules import this package's shared
    parts (tokenizers, text encoders, saving), so importing them here up front would be circular."""
    if name.startswith(("build_", "Tiny")):
        for module_name in TINY_MODULES:
            module = importlib.import_module(module_name)
            if name in vars(module):
                return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.pipelines.tiny",
        description="Build a tiny diffusers pipeline with random weights and save it to a folder.",
    )
    parser.add_argument("out_dir", help="folder to write the pipeline to (created if missing)")
    parser.add_argument(
        "--family",
        choices=list(TINY_BUILDERS),
        default="sd3",
        help=f"{families_help()} (default: sd3)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    TINY_BUILDERS[args.family](args.out_dir, seed=args.seed)
