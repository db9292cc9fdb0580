"""benchmarks/rescore_batches runs end to end on the tiny pipelines: the trainer's copy re-scores
every trajectory of one rollout at each micro-batch (and per trajectory) within the contract, CFG
on and off, and one request alone and in the batch ends within float32 rounding of itself; with
--attention-backend the engine and the trainer's copy both take it; with --compile blocks a
compiled and an eager trainer re-score the compiled rollout."""

from __future__ import annotations

import json

import pytest

from benchmarks import rescore_batches
from rollout.rescoring import RATIO_TOLERANCE

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("family", "extra"),
    [("sd3", []), pytest.param("flux", ["--attention-backend", "_native_math"], marks=pytest.mark.slow)],
)
def test_every_micro_batch_rescores_within_the_contract(tmp_path, tiny_models, family, extra):
    path = tmp_path / "rescore_batches.json"
    argv = ["--model", tiny_models(family), "--batch-size", "4", "--steps", "2", "--json", str(path), *extra]
    report = rescore_batches.main(argv)
    assert json.loads(path.read_text())["results"] == report["results"]
    assert set(report["results"]) == {"on", "off"}
    for cfg in report["results"].values():
        assert set(cfg["rescore"]) == {"1", "2", "4", rescore_batches.PER_TRAJECTORY}
        assert all(0 <= scored["max_abs_log_ratio"] < RATIO_TOLERANCE for scored in cfg["rescore"].values())
        assert 0 <= cfg["alone"] < 1e-4  # the same noise: a batch changes only the rounding
    assert report["header"]["args"]["attention_backend"] == (extra[1] if extra else None)
    assert all(target["met"] for target in report["targets"])


@pytest.mark.slow
def test_a_compiled_rollout_is_rescored_by_a_compiled_and_an_eager_trainer(tiny_models):
    argv = ["--model", tiny_models("sd3"), "--batch-size", "2", "--steps", "2", "--cfg", "off", "--compile", "blocks"]
    report = rescore_batches.main(argv)
    off = report["results"]["off"]
    for trainer in ("rescore", "rescore_eager_trainer"):
        assert set(off[trainer]) == {"1", "2", rescore_batches.PER_TRAJECTORY}
        assert all(0 <= scored["max_abs_log_ratio"] < RATIO_TOLERANCE for scored in off[trainer].values())
    assert all(target["met"] for target in report["targets"])


def test_a_backend_the_model_cannot_take_is_refused_before_anything_runs(tiny_models):
    with pytest.raises(ValueError, match="cannot apply to StableDiffusion3Pipeline"):
        rescore_batches.main(["--model", tiny_models("sd3"), "--attention-backend", "_native_math"])
