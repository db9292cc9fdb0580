"""A user's script sees the project's own output, not third-party progress bars and notices from
every worker process (a 10-step loop used to print 70 such lines)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    from rollout import EngineConfig, RolloutEngine, SamplingParams
    from rollout.pipelines.tiny import build_tiny_sd3
    from trainers_adapters.policy.lora_policy import LoraPolicy

    if __name__ == "__main__":
        path = str(build_tiny_sd3(sys.argv[1]))
        policy = LoraPolicy(path, {"r": 4, "lora_alpha": 8})
        with RolloutEngine(EngineConfig(model=path, executor="mp", num_workers=2)) as engine:
            policy.push(engine)
            engine.generate("x", SamplingParams(num_inference_steps=2, num_samples=2, lora="policy"))
            engine.sleep(2)
            engine.wake_up()
        print("done")
    """
)
NOISE = ("Loading pipeline components", "Loading weights", "Writing model shards", "requires torchvision")


@pytest.mark.timeout(180)
@pytest.mark.slow  # repetition for the default suite: CI runs it (make test-slow)
def test_a_script_with_an_mp_engine_prints_no_third_party_noise(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "tiny")], capture_output=True, text=True, timeout=170
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("done")
    noisy = [line for line in (result.stdout + result.stderr).splitlines() if any(n in line for n in NOISE)]
    assert noisy == [], noisy[:5]
