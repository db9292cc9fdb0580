"""Launch a recipe from its YAML config: `python -m recipes.run CONFIG [--set KEY=VALUE ...]`, or
on N data-parallel trainer ranks: `torchrun --nproc-per-node N -m recipes.run CONFIG ...`, or as N
Ray actors over a cluster's nodes: `python -m recipes.run CONFIG --ray-ranks N ...`."""

from __future__ import annotations

import argparse
import json
import os

import yaml

from recipes.config import config_keys
from recipes.loading import RECIPES, load_config, recipe_module
from recipes.run_log import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.run",
        description=(
            "Run a recipe (a scripted rollout or training run) from a YAML config. The config's `recipe:` "
            "key picks the recipe; every problem in the config is reported at once before anything runs. "
            "Training recipes run on N data-parallel ranks when launched with torchrun --nproc-per-node N -m "
            "recipes.run CONFIG, or as Ray actors with --ray-ranks N (trainer.placement says where they sample)."
        ),
        epilog=_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="the recipe's YAML file, e.g. recipes/configs/rollout_tiny.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "override one config key (repeatable); nested keys are dotted and the value is parsed as YAML, "
            "e.g. --set sampling.num_inference_steps=4 --set 'prompts=[a red square]' --set sampling.seed=null"
        ),
    )
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help=(
            "continue a training run from its checkpoint (written with checkpoint_every): a checkpoint folder, an "
            "output_dir (its latest checkpoint), or auto (the latest in the config's output_dir, else a new run); "
            "the same as --set resume=DIR"
        ),
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help=(
            "print the memory plan of a training config and exit without loading any weights: per device the "
            "weights (engine, trainer, shared), the LoRA with its gradients and AdamW states, and the activation "
            "peak of one micro-batch, estimated on the meta device and fake tensors; the fit is checked against "
            "trainer.device_memory_gib, or the CUDA device's own total (docs/training.md, Memory plan)"
        ),
    )
    parser.add_argument(
        "--plan-ranks",
        type=int,
        metavar="N",
        help=(
            "with --plan: the trainer ranks a policy: full config is sharded over (its master weights, gradients "
            "and AdamW states are 1/N on each); default torchrun's WORLD_SIZE, else 1"
        ),
    )
    parser.add_argument(
        "--ray-ranks",
        type=int,
        metavar="N",
        help=(
            "run a training recipe on N data-parallel trainer ranks as Ray actors in one placement group (a GPU "
            "each with a CUDA engine.device): on the Ray cluster at $RAY_ADDRESS, else on a local Ray; the same "
            "run as torchrun --nproc-per-node N (docs/training.md, Data-parallel training)"
        ),
    )
    return parser


def _keys_help() -> str:
    """Every config key of every recipe with its default and help, generated from the config dataclasses."""
    lines = []
    for name in RECIPES:
        keys = list(config_keys(recipe_module(name).Config))
        width = max(len(key) + len(default) for key, default, _ in keys) + 3
        lines.append(f"config keys of recipe {name!r} (key = default: description):")
        lines += [f"  {f'{key} = {default}':<{width}}  {help_text}" for key, default, help_text in keys]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(os.environ.get("RANK", "0") == "0")  # under torchrun, RANK is this process's
    if args.ray_ranks is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("--ray-ranks starts the ranks itself: launch it with python -m recipes.run, not torchrun")
    try:
        # JSON text is YAML, so the path stays a string whatever it looks like.
        resume = [] if args.resume is None else [f"resume={json.dumps(args.resume)}"]
        # --plan shows a plan that does not fit too: the fit is what it is asked about; and it plans a
        # model.path that is not here from its family's published configs, so only a run needs the folder.
        config = load_config(
            args.config, [*args.overrides, *resume], on_this_machine=not args.plan, check_fit=not args.plan
        )
    except (ValueError, OSError, yaml.YAMLError) as error:
        parser.error(str(error))
    if args.plan:
        from recipes.memory_plan import memory_plan  # torch, diffusers: only when asked

        try:
            print(memory_plan(config, args.plan_ranks).render())
        except ValueError as error:
            parser.error(str(error))
        return
    if args.ray_ranks is not None:
        from recipes.ray_ranks import launch_problem, run_on_ray_ranks  # Ray itself: only when it runs

        problem = launch_problem(config, args.ray_ranks)
        if problem is not None:
            parser.error(problem)
        run_on_ray_ranks(config, args.ray_ranks)
        return
    recipe_module(config.recipe).run(config)


if __name__ == "__main__":
    main()
