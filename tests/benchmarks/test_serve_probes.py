"""The probe run of issue 19 end to end: every probe refused in time, a good request untouched."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_every_probe_is_answered_and_nobody_else_pays(tmp_path):
    import json

    from benchmarks.serve_probes import main

    report = main(["--json", str(tmp_path / "probes.json")])
    assert report["targets"] and all(target["met"] for target in report["targets"]), report["targets"]
    assert len(report["results"]["probes"]) >= 30
    (probes,) = [table for table in report["tables"] if table["title"].startswith("probes")]
    assert len(probes["rows"]) == len(report["results"]["probes"])
    assert json.loads((tmp_path / "probes.json").read_text())["header"]["benchmark"] == "serve_probes"
