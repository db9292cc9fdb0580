"""Where the two passes of classifier-free guidance run: the adapter's `guidance_passes`.

A family's `_predict_velocity` prepares one forward over any rows of a batch (`RowsForward`) and
hands it here; it gets back the conditional prediction of every row and the unconditional one of
the guided rows, and combines them itself (`combine_cfg`, `cfg_scale`). By default both passes run
in this process (`guidance_passes_here`); a CFG-parallel worker runs them on two halves of its
replica group instead (`rollout.parallel.cfg`). Nothing here imports diffusers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.pipelines.condition import PromptEmbeds

# One forward over some rows of a batch: (the rows, as an index, mask or slice; their embeddings) ->
# the transformer's prediction for them, in the model's dtype.
RowsForward = Callable[[torch.Tensor | slice, list[PromptEmbeds]], torch.Tensor]


# Where both passes run, given (run, shape, cfg, prompts, negatives, one_pass): the conditional
# prediction of every row of a batch of latents of `shape`, and the unconditional one of the rows
# `cfg` marks ([B] bool), both float32; None for the second when no row has a negative prompt
# (`negatives` empty). `one_pass`: the family's pipeline runs both in one forward (`cfg_in_one_pass`).
GuidancePasses = Callable[
    [RowsForward, torch.Size, torch.Tensor, list[PromptEmbeds], list[PromptEmbeds], bool],
    tuple[torch.Tensor, torch.Tensor | None],
]


def guidance_passes_here(
    run: RowsForward,
    shape: torch.Size,
    cfg: torch.Tensor,
    prompts: list[PromptEmbeds],
    negatives: list[PromptEmbeds],
    one_pass: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both passes in this process, as the family's pipeline runs them (see `GuidancePasses`)."""
    batch = shape[0]
    if negatives and one_pass:
        rows = torch.cat([torch.arange(batch, device=cfg.device), cfg.nonzero(as_tuple=True)[0]])
        out = run(rows, prompts + negatives).to(torch.float32)
        return out[:batch], out[batch:]
    velocity = run(slice(None), prompts).to(torch.float32)
    return velocity, run(cfg, negatives).to(torch.float32) if negatives else None
