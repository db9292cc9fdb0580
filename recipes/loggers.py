"""Where a training run's metrics go: `metrics.jsonl`, TensorBoard, Weights & Biases (the recipes'
`logger` key; several at once).

Every logger receives the same things: the run's config once (when it opens), each step's record
(the line `metrics.jsonl` holds), and the sample grids as the files the run wrote (PNG, or an
animated GIF for a video model). TensorBoard and wandb are optional extras, imported only when
chosen; the config check names the extra to install before any model loads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from recipes.config import option

logger = logging.getLogger(__name__)

# logger name -> (module it imports, pip extra of this project that installs it); jsonl needs none.
LOGGER_PACKAGES: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}
WANDB_MODES = ("online", "offline", "disabled")


@dataclass(kw_only=True)
class WandbSection:
    """The Weights & Biases run, when `logger` names wandb."""

    project: str = option("diffusion-rollout", "W&B project the run goes to")
    entity: str | None = option(None, "W&B team or user; null: your login's default")
    name: str | None = option(None, "W&B run name; null: W&B picks one")
    mode: str | None = option(
        None,
        f"one of {', '.join(WANDB_MODES)} (offline writes files only; `wandb sync` uploads them later); "
        "null: $WANDB_MODE, else online",
    )

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"mode must be one of {WANDB_MODES} or null, got {self.mode!r}")


def logger_names(value: str | list[str]) -> list[str]:
    """The `logger` key as a list: one name or several, duplicates dropped, in the order given."""
    names = [value] if isinstance(value, str) else value
    return list(dict.fromkeys(names))


def logger_problems(value: str | list[str]) -> list[str]:
    """What is wrong with a `logger` key: unknown names, or a chosen logger whose package is missing."""
    names = logger_names(value)
    if not names:
        return [f"logger is empty; choose one or more of {', '.join(LOGGER_PACKAGES)}"]
    problems = []
    for name in names:
        if name not in LOGGER_PACKAGES:
            problems.append(f"logger {name!r} is unknown; choose one or more of {', '.join(LOGGER_PACKAGES)}")
        elif LOGGER_PACKAGES[name] is not None:
            module, extra = LOGGER_PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                problems.append(
                    f"logger {name!r} needs the {module} package, which is not installed: "
                    f"pip install 'diffusion-rollout[{extra}]' (or pip install {module})"
                )
    return problems


def scalar_metrics(record: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl record under the names TensorBoard and wandb plot them by: a
    number keeps its key; a per-denoising-step dict (`log_ratio_by_step_max`: step index -> value;
    in JSON the index is text) gives one scalar per step, `log_ratio_by_step_max/step_03`. Other
    values (`sde_window`, nulls) and `step`, the x axis, are only in metrics.jsonl."""
    scalars = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            scalars |= {f"{key}/step_{int(index):02d}": float(item) for index, item in value.items()}
        elif isinstance(value, int | float) and not isinstance(value, bool):
            scalars[key] = float(value)
    return scalars


class RunLogger(Protocol):
    """One destination of a run's metrics."""

    def log_scalars(self, step: int, record: dict) -> None:
        """`record`: the step's metrics.jsonl line as a dict (numbers, lists, per-step dicts)."""

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        """`images`: tag -> a PNG, or an animated GIF (a video model's grids), on disk."""

    def close(self) -> None: ...


class JsonlLogger:
    """`metrics.jsonl` in the output folder: one JSON line per step, flushed as it is written.
    Images and the config are in their own files already (the grids, summary.json). A resumed
    run's file is rewritten from the checkpoint's records (`done`): lines a killed run wrote after
    its last checkpoint are dropped, as those steps run again."""

    def __init__(self, output_dir: Path, done: list[dict]):
        self.path = output_dir / "metrics.jsonl"
        self.file = self.path.open("w")
        self.file.writelines(json.dumps(record) + "\n" for record in done)
        self.file.flush()

    def log_scalars(self, step: int, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        pass

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger:
    """Event files under `output_dir/tensorboard` (`tensorboard --logdir OUTPUT_DIR/tensorboard`):
    the scalars of `scalar_metrics`, the grids as images (animated for a video model) and the config
    as text. A resumed run (`first_step` > 0) purges what earlier event files hold from
    `first_step` on (a killed run's steps after its last checkpoint), keeping the steps before."""

    def __init__(self, output_dir: Path, config: dict, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = output_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=first_step or None)
        text = json.dumps(config, indent=2)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()))  # a code block

    def log_scalars(self, step: int, record: dict) -> None:
        for name, value in scalar_metrics(record).items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a step's scalars show while the run goes on

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # The file's own bytes, so TensorBoard shows what the run wrote; an animated GIF stays one
        # (the image dashboard plays it). SummaryWriter has no public call that takes encoded
        # bytes, and its add_video encodes through moviepy, hence its file writer.
        for tag, path in images.items():
            with Image.open(path) as picture:
                width, height = picture.size
            image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=path.read_bytes())
            summary = Summary(value=[Summary.Value(tag=tag, image=image)])
            self.writer._get_file_writer().add_summary(summary, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run (its files under `output_dir/wandb`) with the config, the scalars of
    `scalar_metrics` and the grids (`wandb.Image`, or `wandb.Video` for an animated GIF). A resumed
    run is a new wandb run that starts with the checkpoint's records (`done`), so it holds the whole
    curve."""

    def __init__(self, output_dir: Path, config: dict, settings: WandbSection, done: list[dict]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name,
            mode=settings.mode,  # None: wandb reads $WANDB_MODE
            dir=str(output_dir),
            config=config,
        )
        for record in done:
            self.log_scalars(record["step"], record)

    def log_scalars(self, step: int, record: dict) -> None:
        self.run.log(scalar_metrics(record), step=step)

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        media = {
            tag: self.wandb.Video(str(path), format="gif") if path.suffix == ".gif" else self.wandb.Image(str(path))
            for tag, path in images.items()
        }
        self.run.log(media, step=step)

    def close(self) -> None:
        self.run.finish()


class RunLoggers:
    """The loggers a run chose, called together; as a context manager it closes them all."""

    def __init__(self, loggers: list[RunLogger]):
        self.loggers = loggers

    def log_scalars(self, step: int, record: dict) -> None:
        for run_logger in self.loggers:
            run_logger.log_scalars(step, record)

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        for run_logger in self.loggers:
            run_logger.log_images(step, images)

    def close(self) -> None:
        for run_logger in self.loggers:
            run_logger.close()

    def __enter__(self) -> RunLoggers:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def open_loggers(
    names: str | list[str], output_dir: Path, config: dict, wandb: WandbSection, done: Sequence[dict] = ()
) -> RunLoggers:
    """Open the loggers `names` (checked with `logger_problems`) for a run writing to `output_dir`;
    `config` is the run's config as plain data; `done`: the records of the steps a resumed run has
    behind it (its checkpoint's). If one fails to open, those already open are closed."""
    done = list(done)
    opened: list[RunLogger] = []
    try:
        for name in logger_names(names):
            if name == "jsonl":
                opened.append(JsonlLogger(output_dir, done))
            elif name == "tensorboard":
                opened.append(TensorBoardLogger(output_dir, config, len(done)))
            elif name == "wandb":
                opened.append(WandbLogger(output_dir, config, wandb, done))
            else:
                raise ValueError(f"logger {name!r} is unknown; choose one or more of {', '.join(LOGGER_PACKAGES)}")
    except BaseException:
        RunLoggers(opened).close()
        raise
    logger.info("logging to %s", ", ".join(logger_names(names)))
    return RunLoggers(opened)
