"""The weight versions an engine has held, and the rule for the next one.

A version names one set of weights, and every sample carries the one it ran on, so a trainer can
tell its pushes apart: versions go up. A push may name a version below the current one only where
the engine held that version before: a trainer resumed from a checkpoint re-pushes the checkpoint's
weights under the checkpoint's version, also to a server that outlived it (and went on to later
versions for the trainer that was killed). Any other lower version (17, then -5) is refused, and so
is the current version itself for a push that changes the weights: the samples before and after it
would carry one version for two sets of weights (two trainers of one server counting alike did
that). Versions are 64-bit signed integers, as every peer reads them: a 4300-digit version once made
every answer of a server fail (its header could not be written) until it restarted.
"""

from __future__ import annotations

MIN_VERSION, MAX_VERSION = -(1 << 63), (1 << 63) - 1


class WeightVersions:
    """`current`, and every version held so far, as closed ranges (one per run of versions that
    went up one at a time; a push that names a version of its own may start another)."""

    def __init__(self):
        self.current = 0
        self._held: list[tuple[int, int]] = [(0, 0)]

    def check(self, version: int | None) -> None:
        """Raise ValueError unless `version` is None or a 64-bit signed integer."""
        if version is None:
            return
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be an int or None, got {version!r}")
        if not MIN_VERSION <= version <= MAX_VERSION:
            shown = version if abs(version) < 10**30 else f"an integer of {version.bit_length()} bits"
            raise ValueError(f"version must be a 64-bit signed integer (as every peer reads it), got {shown}")

    def next(self, version: int | None) -> int:
        """The version a push that names `version` (None: the current one plus 1) moves to; a
        ValueError naming the current version if that version may not be taken by a push that
        changes the weights (the current one included: see `names_current`)."""
        self.check(version)
        if version is None:
            if self.current == MAX_VERSION:
                raise ValueError(f"the weight version is at its largest, {MAX_VERSION}; name a lower one held before")
            return self.current + 1
        if version == self.current:
            raise self.current_taken(version)
        if version < self.current and not self.was_held(version):
            raise ValueError(
                f"version {version} is below this engine's weight version {self.current}, and no weights it held "
                "had it: versions go up, so that the samples that carry them tell the pushes apart; pass a version "
                f"> {self.current}, or none for {self.current + 1} (a trainer resumed from a checkpoint may pass "
                "the checkpoint's version to the engine that held it)"
            )
        return version

    def current_taken(self, version: int) -> ValueError:
        """The refusal of a push that names the current version for weights other than its own."""
        return ValueError(
            f"version {version} is this engine's current weight version: it names the weights the engine holds now, "
            "and this push changes them, so the samples before and after it could not be told apart; pass "
            f"{self.current + 1} or none (only a push that repeats what the engine holds exactly, weights or the live "
            "adapter of its name, may name the current version: a resumed trainer re-pushing its checkpoint)"
        )

    def names_current(self, version: int | None) -> bool:
        """Whether a push names the current version: only a push that changes nothing may (a
        trainer resumed from a checkpoint re-pushing it to the server that holds it)."""
        return version is not None and not isinstance(version, bool) and version == self.current

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
