"""The project's warnings and errors in a script that configured no logging, with a format.

Python prints a record that no handler takes through `logging.lastResort`: its message alone, so
"engine is dead: worker rank 0 ... died" came with no time, level or source, and from a worker
process no word of which one. The project's package loggers (rollout, executors,
trainers_adapters) carry `FormattedLastResort`, which does what the last resort does (WARNING
and above, to stderr, only while no other handler would take the record) with a format that
says when, how bad, which process and which module. Once the application configures logging
(`logging.basicConfig`, pytest's capture, a recipe, the server), its handlers take every record
and this one stays silent: nothing of the user's logging setup changes.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


class FormattedLastResort(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if self._another_handler_takes(record):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)

    def _another_handler_takes(self, record: logging.LogRecord) -> bool:
        """Whether a handler other than these would emit `record` (the walk `Logger.callHandlers` makes)."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(not isinstance(h, FormattedLastResort) and record.levelno >= h.level for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


PACKAGES = ("rollout", "executors", "trainers_adapters")


def install() -> None:
    """Give the project's package loggers the formatted last resort, once per process. An engine's
    executor installs it in its process, and each worker in its own, as they start: importing the
    project changes no logging."""
    for package in PACKAGES:
        logger = logging.getLogger(package)
        if not any(isinstance(handler, FormattedLastResort) for handler in logger.handlers):
            logger.addHandler(FormattedLastResort())
