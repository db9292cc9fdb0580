"""The benchmark harness: one percentile, targets as data, reports that render into the docs page."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import harness, render

pytestmark = pytest.mark.timeout(60)


def test_one_percentile_definition_is_linear_interpolation():
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    inclusive = statistics.quantiles(values, n=100, method="inclusive")
    for q in (1, 50, 90, 99):
        assert harness.percentile(values, q) == pytest.approx(inclusive[q - 1])
    stats = harness.Stats.of(values, scale=1e3)
    assert (stats.min, stats.median, stats.max) == pytest.approx((100, 350, 900))
    assert harness.percentile([5.0], 99) == 5.0


def test_targets_compare_as_their_operator_says():
    assert harness.Target("speed", 1.0, ">=", 0.95).met
    assert not harness.Target("latency ms", 51.0, "<", 50).met
    assert harness.Target("blocks left", 0, "==", 0).met
    assert "MISSED" in str(harness.Target("x", 2.0, "<=", 1.0))
    with pytest.raises(ValueError, match="op '=<'"):
        harness.Target("x", 1.0, "=<", 2.0)


def test_rounds_interleave_and_keep_only_the_timed_ones():
    order = []

    def mode(name):
        def run(round_):
            order.append((round_.index, name))
            return {"s": float(round_.index), "MB": 1.0}

        return run

    samples = harness.run_rounds({"a": mode("a"), "b": mode("b")}, warmup=1, repeats=2, quiet=True)
    assert order == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "b"), (2, "a")]
    assert samples == {"a": {"s": [1.0, 2.0], "MB": [1.0, 1.0]}, "b": {"s": [1.0, 2.0], "MB": [1.0, 1.0]}}


def test_over_two_cycles_each_mode_runs_first_as_often_and_follows_every_other():
    modes = ["engine", "diffusers", "floor"]
    orders = [round_.order for round_ in harness.interleaved_rounds(modes, warmup=0, repeats=2 * len(modes))]
    assert sorted(order[0] for order in orders) == sorted(modes * 2)
    followed = {(order[i], order[i + 1]) for order in orders for i in range(len(order) - 1)}
    assert followed == {(a, b) for a in modes for b in modes if a != b}  # a rotation alone gives 3 of these 6


def test_shared_options_have_one_name_and_the_report_renders(tmp_path, capsys):
    parser = harness.parser("demo", "What demo measures.\n\nWhy.", repeats=3, warmup=1, device="cpu")
    assert "--rounds" not in parser.format_help() and "--repeats" in parser.format_help()
    args = parser.parse_args(["--repeats", "2", "--json", str(tmp_path / "results" / "demo.json")])
    with pytest.raises(SystemExit):
        parser.parse_args(["--repeats", "0"])
    report = harness.Report("demo", args, "What demo measures.\n\nWhy.", ["--repeats", "2"])
    report.table("speed", ["mode", "median s"], [["engine", 0.123456], ["diffusers | pipeline", 2.0]])
    report.note("one note")
    report.check(harness.Target("engine / diffusers speed", 1.02, ">=", 0.95))
    report.check(harness.Target("floor ratio", 1.5, "<=", 1.1))
    report.results["modes"] = {"engine": harness.Stats.of([0.1, 0.2])}
    report.finish()
    written = json.loads((tmp_path / "results" / "demo.json").read_text())
    header = written["header"]
    assert header["command"] == "python -m benchmarks.demo --repeats 2"
    assert {"commit", "torch", "threads", "device", "device_name", "started"} <= set(header)
    assert written["results"]["modes"]["engine"]["median"] == pytest.approx(0.15)
    assert "speed" in capsys.readouterr().out
    page = render.render([written])
    assert "| engine | 0.1235 |" in page and "diffusers \\| pipeline" in page
    assert "- engine / diffusers speed: 1.02 >= 0.95: met" in page
    assert "- floor ratio: 1.5 <= 1.1: **MISSED**" in page
    assert "| [demo --repeats 2](#demo---repeats-2) | 1 of 2 |" in page
    readme = tmp_path / "README.md"
    readme.write_text(f"front\n{render.HEADLINE_START}\nold line\n{render.HEADLINE_END}\nback\n")
    argv = ["--results", str(tmp_path / "results"), "--out", str(tmp_path / "benchmarks.md"), "--readme", str(readme)]
    assert render.main(argv).read_text() == page
    assert "old line" not in readme.read_text() and readme.read_text().endswith(f"{render.HEADLINE_END}\nback\n")


def test_the_readme_headlines_come_from_the_reports():
    sd3 = {
        "header": {"command": "python -m benchmarks.rollout_throughput --family sd3", "device": "cpu", "threads": 2}
        | {"commit": "abc"},
        "targets": [{"name": "engine / diffusers speed", "value": 1.016, "op": ">=", "goal": 0.95, "met": True}],
    }
    (line,) = render.headline_lines([sd3])
    assert "engine / diffusers speed 1.016 (target >= 0.95; cpu, 2 threads, `abc`)" in line
    readme = (render.ROOT / "README.md").read_text()
    assert render.HEADLINE_START in readme and render.HEADLINE_END in readme
