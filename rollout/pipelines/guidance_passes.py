"""Where the two passes of classifier-free guidance run: the adapter's `guidance_passes`.

A family's `_predict_velocity` prepares one forward over any rows of a batch (`RowsForward`) and
hands it here; it gets back the conditional prediction of every row and the unconditional one of
the guided rows, and combines them itself (`combine_cfg`, `cfg_scale`). By default both passes run
in this process (`guidance_passes_here`); a CFG-parallel worker runs them on two halves of its
replica group instead (`rollout.parallel.cfg`). Nothing here imports diffusers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rollout.condition import PromptEmbeds

# One forward over some rows of a batch: (the rows, as host row numbers; their embeddings) -> the
# transformer's prediction for them, in the model's dtype. The rows are known on the host (which
# conditions have a negative prompt), so selecting them never asks the device (no boolean mask).
RowsForward = Callable[[Sequence[int], list[PromptEmbeds]], torch.Tensor]


# Where both passes run, given (run, latents, cfg_rows, prompts, negatives, one_pass): the
# conditional prediction of every row of the batch `latents` (read for its shape and device), and
# the unconditional one of the rows `cfg_rows` (host row numbers, ascending), both float32; None for
# the second when no row has a negative prompt (`negatives` empty). `one_pass`: the family's
# pipeline runs both in one forward (`cfg_in_one_pass`).
GuidancePasses = Callable[
    [RowsForward, torch.Tensor, Sequence[int], list[PromptEmbeds], list[PromptEmbeds], bool],
    tuple[torch.Tensor, torch.Tensor | None],
]


def guidance_passes_here(
    run: RowsForward,
    latents: torch.Tensor,
    cfg_rows: Sequence[int],
    prompts: list[PromptEmbeds],
    negatives: list[PromptEmbeds],
    one_pass: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both passes in this process, as the family's pipeline runs them (see `GuidancePasses`)."""
    batch = latents.shape[0]
    if negatives and one_pass:
        out = run([*range(batch), *cfg_rows], prompts + negatives).to(torch.float32)
        return out[:batch], out[batch:]
    velocity = run(range(batch), prompts).to(torch.float32)
    return velocity, run(cfg_rows, negatives).to(torch.float32) if negatives else None
