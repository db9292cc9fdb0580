"""A user's reward (named by dotted path in a config) that fails on trainer rank 1 alone: how a
rank's own code breaks mid-run (a reward model that cannot load or score there), for the tests of
the launchers' failure handling. Elsewhere it is the built-in colour reward."""

from __future__ import annotations

import os

from trainers_adapters.rewards.builtin import colour_target


def colour_except_on_rank_1(images, prompts, metadata):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("this reward cannot score on trainer rank 1")
    return colour_target(images, prompts, metadata)
