"""The check every reward's output passes before it can reach an update: one finite float32 per
sample. A NaN, an inf or a wrong count fails the step with a `RewardError` that names the reward
and the samples (by prompt, sample and branch), while nothing has been updated yet.

Before this check, a reward that returned NaN for one image made that group's advantages NaN; the
loss guard caught it only later, in the update, and named no reward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RewardError(ValueError):
    """A reward returned something that must not reach an update."""


def checked_scores(name: str, scores, metadata: Sequence[dict]) -> torch.Tensor:
    """`scores` as float32 [N] on CPU, N = len(metadata); raises RewardError naming reward `name`
    and the offending samples when it is not one finite number per sample."""
    count = len(metadata)
    try:
        values = torch.as_tensor(scores)
    except (TypeError, ValueError, RuntimeError) as error:
        raise RewardError(
            f"reward {name!r} returned a {type(scores).__name__} for {count} images "
            f"({samples(range(count), metadata)}); expected a tensor of {count} numbers"
        ) from error
    if values.shape != (count,):
        raise RewardError(
            f"reward {name!r} returned shape {tuple(values.shape)} for {count} images "
            f"({samples(range(count), metadata)}); expected [{count}], one number per image"
        )
    values = values.detach().to("cpu", torch.float32)  # a float64 beyond float32's range becomes inf here
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        found = sorted({str(values[row].item()) for row in bad})
        raise RewardError(
            f"reward {name!r} returned {' and '.join(found)} for {len(bad)} of {count} samples "
            f"({samples(bad, metadata)}); a reward must return finite numbers, so the step stops before any update"
        )
    return values


def samples(rows, metadata: Sequence[dict]) -> str:
    """The samples at `rows` as a reader finds them: "prompt 0 sample 1, prompt 0 sample 3"; rows
    whose metadata does not say (a direct call) by their row."""
    named = []
    for row in rows:
        meta = metadata[row]
        if "prompt_index" not in meta or "sample_index" not in meta:
            named.append(f"row {row}")
            continue
        where = f"prompt {meta['prompt_index']} sample {meta['sample_index']}"
        if meta.get("branch_path"):
            where += f" branch {list(meta['branch_path'])}"
        named.append(where)
    return ", ".join(named)
