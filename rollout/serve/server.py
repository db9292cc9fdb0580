"""The rollout service's uvicorn server, which stops the engine within a bound when told to stop.

uvicorn alone waits without limit for open responses on SIGTERM or Ctrl-C (a streamed rollout may
run for minutes), then re-raises the signal, which skips whatever follows `run()`. Here running
requests get `grace_s` to finish while no new one starts; then every unfinished request ends with
an error naming the shutdown (a streamed answer gets it as its error frame), and the engine and its
workers stop before the process exits. A connection still open a moment after that (a client that
does not read its stream, a push whose body still trickles in) is closed: uvicorn would wait for it
without limit, and a push would hold the process for as long as its client sends.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from rollout.engine.async_engine import AsyncRolloutEngine
from rollout.errors import EngineDeadError

logger = logging.getLogger(__name__)


_FLUSH_S = 1.0  # after the grace, for the error answers to go out to clients that read them


class RolloutServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncRolloutEngine, grace_s: float):
        # uvicorn's own bound, should a task outlive its connection: cancelled past it.
        config.timeout_graceful_shutdown = grace_s + _FLUSH_S + 5.0
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn's own shutdown waits for every open response; the engine's requests end in time.
        ending = asyncio.create_task(self._end_requests())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()
            await asyncio.to_thread(self.engine.shutdown)

    async def _end_requests(self) -> None:
        loop = asyncio.get_running_loop()
        grace_ends = loop.time() + self.grace_s
        try:
            # "wait": the running requests finish, the queued ones are not started.
            await asyncio.wait_for(self.engine.pause("wait"), self.grace_s)
        except TimeoutError:
            logger.warning("running requests did not finish within --shutdown-grace-s %s; ending them", self.grace_s)
        await self.engine.fail_all(EngineDeadError("the rollout server is shutting down; send the request again"))
        close_at = max(grace_ends, loop.time() + _FLUSH_S)
        while self.server_state.connections and loop.time() < close_at:
            await asyncio.sleep(0.05)
        if self.server_state.connections:
            logger.warning(
                "closing %d connections still open after --shutdown-grace-s %s (a client not reading its answer, "
                "or a body still arriving)",
                len(self.server_state.connections),
                self.grace_s,
            )
        for connection in list(self.server_state.connections):
            connection.transport.abort()  # close() would wait for a client that does not read to take the rest
