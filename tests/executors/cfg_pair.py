"""The two ranks of a CFG-parallel pair without a model, for tests: each process joins a gloo
group of two and runs `CfgParallelPasses` over a forward that is plain arithmetic on its rows.

Run by `torch.multiprocessing.spawn`, which imports this module in the children."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from rollout.parallel.cfg import CfgParallelPasses
from rollout.parallel.sequence import group_mesh
from rollout.pipelines.guidance_passes import guidance_passes_here

LATENTS = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
CFG_ROWS = [0, 2]  # the rows with a negative prompt


def forward(fail_on: str | None):
    """A stand-in for the transformer: each row's latents scaled by its text's length (so the
    conditional and the unconditional predictions differ); raises for the text `fail_on`."""

    def run(rows, texts: list[str]) -> torch.Tensor:
        if fail_on in texts:
            raise ValueError(f"injected failure for {fail_on!r}")
        return LATENTS[list(rows)] * torch.tensor([float(len(t)) for t in texts]).view(-1, 1)

    return run


def passes_of_one_rank(rank: int, store_path: str, results: str) -> None:
    """Run a mixed batch, a batch without negative prompts, and a batch whose unconditional pass
    fails, and save what each gave (or raised) to `results`/rank{rank}.pt."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        passes = CfgParallelPasses(group_mesh(2, 1, "cpu"))
        prompts, negatives = ["a", "bb", "ccc"], ["", ""]
        outcome = {
            "want": guidance_passes_here(forward(None), LATENTS, CFG_ROWS, prompts, negatives, False),
            "got": passes(forward(None), LATENTS, CFG_ROWS, prompts, negatives, False),
            "no_negatives": passes(forward(None), LATENTS, [], prompts, [], False),
        }
        try:
            passes(forward(""), LATENTS, CFG_ROWS, prompts, negatives, False)  # "": the negative prompts' text
        except Exception as error:
            outcome["error"] = f"{type(error).__name__}: {error}"
        torch.save(outcome, f"{results}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
