"""The probe run of issue 19 end to end: every probe refused in time, a good request untouched."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_every_probe_is_answered_and_nobody_else_pays():
    from benchmarks.serve_probes import main

    result = main([])
    assert all(result["checks"].values()), result["checks"]
    assert len(result["probes"]) >= 30
