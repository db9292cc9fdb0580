"""The generators a training run draws from, and their state as a checkpoint keeps it.

The rollout seeds and the SDE window's place are derived from the run's seed and the step (see
`recipes.training`), so a resumed run needs no state for them; what is drawn in sequence is: the
prompt order, the minibatch order (and DPO's sigmas and noise) from the update's generator, and
torch's global generator (the LoRA's init draws from it; a user's reward or update may too).
"""

from __future__ import annotations

import random

import torch


class PromptOrder:
    """Training prompts in a seeded random order, reshuffled after each pass."""

    def __init__(self, prompts: list[str], seed: int):
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.queue: list[str] = []

    def take(self, count: int) -> list[str]:
        taken = []
        while len(taken) < count:
            if not self.queue:
                self.queue = self.rng.sample(self.prompts, len(self.prompts))
            taken.append(self.queue.pop())
        return taken

    def state(self) -> dict:
        return {"random": self.rng.getstate(), "queue": list(self.queue)}

    def set_state(self, state: dict) -> None:
        self.rng.setstate(state["random"])
        self.queue = list(state["queue"])


def rng_state(prompt_order: PromptOrder, generator: torch.Generator) -> dict:
    """The state of every generator the loop draws from in sequence: tensors, tuples and lists,
    which `torch.load(weights_only=True)` reads back."""
    return {"torch": torch.get_rng_state(), "minibatch": generator.get_state(), "prompt_order": prompt_order.state()}


def restore_rng(rng: dict, prompt_order: PromptOrder, generator: torch.Generator) -> None:
    """Put every generator back where `rng_state` found it."""
    torch.set_rng_state(rng["torch"])
    generator.set_state(rng["minibatch"])
    prompt_order.set_state(rng["prompt_order"])
