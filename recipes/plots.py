"""The plots training recipes write: reward against step, and GRPO's rollout/train agreement."""

from __future__ import annotations

from pathlib import Path

from rollout.rescoring import RATIO_TOLERANCE


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def plot_reward(history: list[dict], path: Path, title: str) -> None:
    """Mean reward per step with a band of one standard deviation across the step's samples, and a
    moving average over 5 steps; written as a PNG."""
    plt = _pyplot()

    steps = [record["step"] for record in history]
    means = [record["reward_mean"] for record in history]
    stds = [record["reward_std"] for record in history]
    window = 5
    smooth = []
    for i in range(len(means)):
        recent = means[max(0, i - window + 1) : i + 1]
        smooth.append(sum(recent) / len(recent))
    low = [m - s for m, s in zip(means, stds, strict=True)]
    high = [m + s for m, s in zip(means, stds, strict=True)]
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.fill_between(steps, low, high, alpha=0.2, label="± std across samples")
    axes.plot(steps, means, marker=".", linewidth=1, label="mean reward")
    axes.plot(steps, smooth, linewidth=2, label=f"moving average ({window} steps)")
    axes.set_xlabel("training step")
    axes.set_ylabel("reward")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_log_ratio(history: list[dict], path: Path, title: str, tolerance: float = RATIO_TOLERANCE) -> None:
    """Max |log ratio| before the update against training step, one line per denoising step (the
    records' `log_ratio_by_step_max`: step index -> value), with `tolerance` drawn across; written
    as a PNG. The y axis is logarithmic down to 1e-9 and linear below it, so exact zeros (a
    float32 re-scoring often matches bit for bit) still show."""
    plt = _pyplot()

    series: dict[int, tuple[list[int], list[float]]] = {}
    for record in history:
        for index, value in record["log_ratio_by_step_max"].items():
            steps, values = series.setdefault(int(index), ([], []))
            steps.append(record["step"])
            values.append(value)
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    colours = plt.get_cmap("viridis")
    for number, index in enumerate(sorted(series)):
        steps, values = series[index]
        colour = colours(number / max(1, len(series) - 1))
        axes.plot(steps, values, marker=".", linewidth=1, color=colour, label=f"denoising step {index}")
    axes.axhline(tolerance, color="red", linestyle="--", linewidth=1, label=f"tolerance {tolerance:g}")
    axes.set_yscale("symlog", linthresh=1e-9)
    axes.set_xlabel("training step")
    axes.set_ylabel("max |log ratio| before the update")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncol=2 if len(series) > 6 else 1)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_runs(runs: dict[str, list[list[dict]]], path: Path, title: str) -> None:
    """Mean reward against update (left) and against wall-clock time (right) of several runs of
    each kind (`runs`: kind -> one metrics history per run, one line each); written as a PNG."""
    plt = _pyplot()

    figure, (by_update, by_wall) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    colours = plt.get_cmap("tab10")
    for number, (kind, histories) in enumerate(runs.items()):
        for index, history in enumerate(histories):
            label = kind if index == 0 else None
            rewards = [record["reward_mean"] for record in history]
            style = {"color": colours(number), "alpha": 0.7, "label": label}
            by_update.plot([record["step"] for record in history], rewards, **style)
            by_wall.plot([record["wall_s"] for record in history], rewards, **style)
    by_update.set_xlabel("update")
    by_wall.set_xlabel("wall-clock time (s)")
    for axes in (by_update, by_wall):
        axes.set_ylabel("mean reward")
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
