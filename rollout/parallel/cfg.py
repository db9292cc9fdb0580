"""CFG parallel inside one replica group: the two passes of classifier-free guidance at once, on
two halves of the group.

With `cfg_parallel=2` a group of 2 x `sequence_parallel` ranks is a device mesh of dims ("cfg",
"ring", "ulysses") (`rollout.parallel.sequence.group_mesh`): the first half (cfg coordinate 0)
runs the conditional forward of every row of a batch, the second the unconditional forward of the
rows with a negative prompt, each half sharded over its own Ulysses sub-group when
`sequence_parallel` > 1. Paired ranks of the two halves then exchange their predictions (one
all_gather over the mesh's "cfg" dim), and every rank combines them with the family's own
`combine_cfg` and `cfg_scale`, so every rank holds the same velocity and takes the same sampler
step. A batch without negative prompts runs on the first half only and its prediction is shared
the same way. (The split is the one xDiT and vllm-omni call CFG parallel; the code is our own.)

The passes are split for every family, `cfg_in_one_pass` ones too (SD3 and Z-Image concatenate
them in one forward on one device): a forward of B rows and one of K rows instead of one of B + K
gives each row's prediction within float rounding of the single forward's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rollout.condition import PromptEmbeds
from rollout.device_copy import row_index
from rollout.pipelines.guidance_passes import RowsForward

logger = logging.getLogger(__name__)

CONDITIONAL_HALF = 0  # the cfg coordinate of the half that runs the conditional rows (and replies)


class CfgParallelPasses:
    """The adapter's `guidance_passes` on a rank of a CFG-parallel group (see the module's doc)."""

    def __init__(self, mesh: DeviceMesh):
        cfg = mesh["cfg"]
        self.group = cfg.get_group()  # this rank and its pair in the other half
        self.half = cfg.get_local_rank()
        logger.info("CFG parallel: this rank runs the %s rows", "conditional" if self.half == 0 else "unconditional")

    def __call__(
        self,
        run: RowsForward,
        latents: torch.Tensor,
        cfg_rows: Sequence[int],
        prompts: list[PromptEmbeds],
        negatives: list[PromptEmbeds],
        one_pass: bool,  # both passes are split, whatever the family's pipeline does on one device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        failure = None
        try:
            mine = self._my_pass(run, latents, cfg_rows, prompts, negatives)
        except Exception as error:  # the pair must still meet, or it would wait for this rank till timeout
            failure, mine = error, latents.new_zeros(latents.shape, dtype=torch.float32)
        self._check_both_ran(failure, latents.device)
        cond, uncond = torch.empty_like(mine), torch.empty_like(mine)
        dist.all_gather([cond, uncond], mine, group=self.group)  # in the mesh's cfg order: conditional first
        if not negatives:
            return cond, None
        return cond, uncond[row_index(cfg_rows, latents.shape[0], latents.device)]

    def _my_pass(self, run, latents, cfg_rows, prompts, negatives) -> torch.Tensor:
        """This half's prediction as a [B, ...] float32 tensor: every row's conditional one, or the
        unconditional one in the rows `cfg_rows` (zeros elsewhere, so both halves send one shape)."""
        batch = latents.shape[0]
        if self.half == CONDITIONAL_HALF:
            return run(range(batch), prompts).to(torch.float32)
        out = latents.new_zeros(latents.shape, dtype=torch.float32)
        if negatives:
            out[row_index(cfg_rows, batch, latents.device)] = run(cfg_rows, negatives).to(torch.float32)
        return out

    def _check_both_ran(self, failure: Exception | None, device: torch.device) -> None:
        """Raise on both halves when either pass failed: this rank's own error, or one that names the
        other half (whose rank reports the original)."""
        ran = torch.tensor([failure is None], dtype=torch.int32, device=device)
        both = [torch.empty_like(ran), torch.empty_like(ran)]
        dist.all_gather(both, ran, group=self.group)
        if failure is not None:
            raise failure
        if not all(bool(flag) for flag in both):
            other = "unconditional" if self.half == CONDITIONAL_HALF else "conditional"
            raise RuntimeError(
                f"the {other} pass of classifier-free guidance failed on the other half of this CFG-parallel "
                "group (that rank reports the error)"
            )
