"""The reward-against-step plot that training recipes write."""

from __future__ import annotations

from pathlib import Path


def plot_reward(history: list[dict], path: Path, title: str) -> None:
    """Mean reward per step with a band of one standard deviation across the step's samples, and a
    moving average over 5 steps; written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

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
