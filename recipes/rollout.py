"""The scripted rollout recipe: sample each prompt `num_samples` times, write an image grid and a summary.

    python -m recipes.run recipes/configs/rollout_tiny.yaml

Writes under `output_dir`: `grid.png` (one row per prompt, one column per sample, upscaled with
nearest-neighbour so tiny images stay visible) and `summary.json` (per sample: ids, seed, log-probs of
the SDE steps, latent statistics, timings; per run: the config, wall time and throughput).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from recipes.config import EngineSection, ModelSection, RecipeConfig, check_setup, option, to_dict
from rollout import SamplingParams

if TYPE_CHECKING:
    from rollout import RolloutOutput

logger = logging.getLogger(__name__)

GRID_GAP_PX = 2  # white pixels between the cells of grid.png, so neighbouring samples stay apart


@dataclass(kw_only=True)
class Config(RecipeConfig):
    model: ModelSection = option(factory=ModelSection)
    engine: EngineSection = option(factory=EngineSection)
    sampling: SamplingParams = option(factory=SamplingParams)
    prompts: list[str] = option(help="prompts to sample; each one is a row of grid.png")
    output_dir: str = option("outputs/rollout_tiny", "folder for grid.png and summary.json (created if missing)")
    grid_scale: int = option(4, "nearest-neighbour upscale factor of each image in grid.png")

    @classmethod
    def value_problems(cls, values: dict) -> list[str]:
        problems = []
        if values.get("prompts") == []:
            problems.append("prompts is empty; give at least one prompt")
        if values.get("grid_scale", 1) < 1:
            problems.append(f"grid_scale must be an integer >= 1, got {values['grid_scale']}")
        return problems

    def import_problems(self) -> list[str]:
        problems = self.engine.class_problems()
        return [f"engine: {'; '.join(problems)}"] if problems else []


def run(config: Config) -> dict:
    """Run the rollout and write its files; returns the summary written to summary.json."""
    check_setup(config)  # the model folder and a rollout service's answer, before anything is built or loaded
    model_path = config.model.resolve_path()
    started = time.perf_counter()
    with config.engine.open_engine(model_path) as engine:
        engine_start_s = time.perf_counter() - started
        generate_started = time.perf_counter()
        outputs = engine.generate(config.prompts, config.sampling, use_tqdm=True)
        generate_s = time.perf_counter() - generate_started

    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if config.sampling.output_type == "image":
        grid_path = save_samples(outputs, config.grid_scale, output_dir / "grid")
        logger.info("wrote %s (rows: %s)", grid_path, " | ".join(config.prompts))
    else:
        logger.info("no grid: sampling.output_type is not image")
    summary = {
        "config": to_dict(config),
        "model_path": model_path,
        "num_prompts": len(config.prompts),
        "num_samples": len(outputs),
        "engine_start_s": engine_start_s,
        "wall_time_s": generate_s,
        "images_per_s": len(outputs) / generate_s,
        "samples": [sample_summary(output) for output in outputs],
    }
    summary_path = output_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    logger.info(
        "wrote %s: %d samples in %.2f s (%.1f images/s, engine start %.2f s)",
        summary_path,
        len(outputs),
        generate_s,
        summary["images_per_s"],
        engine_start_s,
    )
    return summary


def save_samples(outputs: list[RolloutOutput], scale: int, stem: Path) -> Path:
    """Save the outputs' grid: `stem`.png for images, an animated `stem`.gif for videos (one grid
    per frame, 8 frames per second); returns the file's path."""
    if outputs[0].video is None:
        path = stem.with_suffix(".png")
        image_grid(outputs, scale).save(path)
        return path
    num_frames = outputs[0].video.shape[0]
    frames = [image_grid(outputs, scale, frame=index) for index in range(num_frames)]
    path = stem.with_suffix(".gif")
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=125, loop=0)
    return path


def image_grid(outputs: list[RolloutOutput], scale: int, frame: int | None = None) -> Image.Image:
    """A grid with one row per prompt and one column per output of it (a sample, or a leaf of a tree
    rollout), in the order given; every image upscaled `scale` times. For videos, of frame `frame`."""
    pictures = [output.image if frame is None else output.video[frame] for output in outputs]
    _, height, width = pictures[0].shape
    cell_h, cell_w = height * scale, width * scale
    column_of = []
    taken: dict[int, int] = {}  # prompt index -> columns used
    for output in outputs:
        column_of.append(taken.get(output.prompt_index, 0))
        taken[output.prompt_index] = column_of[-1] + 1
    rows = 1 + max(taken)
    cols = max(taken.values())
    size = (cols * cell_w + (cols - 1) * GRID_GAP_PX, rows * cell_h + (rows - 1) * GRID_GAP_PX)
    grid = Image.new("RGB", size, "white")
    for output, picture, column in zip(outputs, pictures, column_of, strict=True):
        tile = Image.fromarray(picture.permute(1, 2, 0).numpy())
        tile = tile.resize((cell_w, cell_h), Image.Resampling.NEAREST)
        grid.paste(tile, (column * (cell_w + GRID_GAP_PX), output.prompt_index * (cell_h + GRID_GAP_PX)))
    return grid


def sample_summary(output: RolloutOutput) -> dict:
    """JSON-able facts about one sample. `log_probs` has one entry per step, null for ODE steps."""
    summary = {
        "request_id": output.request_id,
        "prompt": output.prompt,
        "prompt_index": output.prompt_index,
        "sample_index": output.sample_index,
        "branch_path": list(output.branch_path),
        "seed": output.seed,
        "status": output.status,
        "weight_version": output.weight_version,
        "timings": dataclasses.asdict(output.timings),
    }
    trajectory = output.trajectory
    if trajectory is not None:
        mask = trajectory.sde_mask
        final = trajectory.latents[-1]
        summary |= {
            "log_prob_sum": float(trajectory.log_probs[mask].sum()),
            "log_probs": [
                lp if sde else None for lp, sde in zip(trajectory.log_probs.tolist(), mask.tolist(), strict=True)
            ],
            "sde_mask": mask.tolist(),
            "latent_shape": [trajectory.latents.length, *trajectory.latents.shape[1:]],  # the whole chain
            "final_latent_mean": float(final.mean()),
            "final_latent_std": float(final.std()),
        }
    return summary
