"""`print(output)` shows one short line per output (ids, status, shapes, versions), never the
tensors' values."""

from __future__ import annotations

import pytest

from rollout import SamplingParams


@pytest.mark.timeout(60)
def test_outputs_and_trajectories_print_on_one_short_line(engine):
    params = SamplingParams(num_inference_steps=3, record=("x0",), record_steps=(1,), seed=0)
    (output,) = engine.generate("a red square " * 20, params)
    for text, bound in ((repr(output), 300), (repr(output.trajectory), 500), (repr(output.trajectory.latents), 120)):
        assert "\n" not in text and "tensor(" not in text and len(text) < bound, text
    assert f"request_id={output.request_id!r}" in repr(output) and "status='finished'" in repr(output)
    assert "image=uint8[3, 32, 32]" in repr(output) and "weight_version=0" in repr(output)
    assert "log_probs=float32[3]" in repr(output.trajectory)
