"""The weight versions an engine has held, and the rule for the next one.

A version names one set of weights, and every sample carries the one it ran on, so a trainer can
tell its pushes apart: versions go up. A push may name a version below the current one only where
the engine held that version before: a trainer resumed from a checkpoint re-pushes the checkpoint's
weights under the checkpoint's version, also to a server that outlived it (and went on to later
versions for the trainer that was killed). Any other lower version (17, then -5) is refused.
"""

from __future__ import annotations


class WeightVersions:
    """`current`, and every version held so far, as closed ranges (one per run of versions that
    went up one at a time; a push that names a version of its own may start another)."""

    def __init__(self):
        self.current = 0
        self._held: list[tuple[int, int]] = [(0, 0)]

    def next(self, version: int | None) -> int:
        """The version a push that names `version` (None: the current one plus 1) moves to; a
        ValueError naming the current version if that version may not be taken."""
        if version is None:
            return self.current + 1
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be an int or None, got {version!r}")
        if version < self.current and not self.was_held(version):
            raise ValueError(
                f"version {version} is below this engine's weight version {self.current}, and no weights it held "
                "had it: versions go up, so that the samples that carry them tell the pushes apart; pass a version "
                f">= {self.current}, or none for {self.current + 1} (a trainer resumed from a checkpoint may pass "
                "the checkpoint's version to the engine that held it)"
            )
        return version

    def move_to(self, version: int) -> None:
        """The engine holds `version` now (checked by `next`)."""
        self.current = version
        if self.was_held(version):
            return
        low, high = self._held[-1]
        if version == high + 1:
            self._held[-1] = (low, version)
        else:
            self._held.append((version, version))

    def was_held(self, version: int) -> bool:
        return any(low <= version <= high for low, high in self._held)
