"""The image budget on its own (`rollout.serve.admission.ImageBudget`): first come, first served; a
caller that leaves while it waits takes nothing; a share is given back once, also when dropped."""

from __future__ import annotations

import asyncio
import gc

import pytest
from fastapi import HTTPException

from rollout.serve.admission import ImageBudget

pytestmark = pytest.mark.timeout(30)


def test_shares_wait_their_turn_and_are_given_back_once():
    async def run() -> None:
        budget = ImageBudget(10)
        first = await budget.take(6)
        second = asyncio.ensure_future(budget.take(6))  # waits for the first
        third = asyncio.ensure_future(budget.take(3))  # fits now, but comes after the second
        await asyncio.sleep(0.01)
        assert not second.done() and not third.done() and budget.held == 6
        first.give_back()
        first.give_back()  # once only
        await asyncio.sleep(0.01)
        assert second.done() and third.done() and budget.held == 9
        (await second).give_back()
        del third  # the task holds the last reference to its share: dropped unreturned
        gc.collect()
        await asyncio.sleep(0.01)
        assert budget.held == 0
        with pytest.raises(HTTPException, match="take 1.91e-05 MiB decoded, over this server's budget"):
            await budget.take(20)

    asyncio.run(run())


def test_a_caller_that_leaves_while_it_waits_takes_nothing():
    async def run() -> None:
        budget = ImageBudget(10)
        held = await budget.take(8)
        leaving = asyncio.ensure_future(budget.take(5))
        behind = asyncio.ensure_future(budget.take(2))  # fits, but waits behind the one that leaves
        await asyncio.sleep(0.01)
        leaving.cancel()
        await asyncio.sleep(0.01)
        assert behind.done() and budget.held == 10
        held.give_back()
        (await behind).give_back()
        assert budget.held == 0

    asyncio.run(run())
