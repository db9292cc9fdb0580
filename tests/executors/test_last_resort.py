"""A script that configured no logging still gets the engine's warnings with a format (time, level,
process, module), from the engine's process and its workers alike; once the application configures
logging, its own handlers print them and nothing else does."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

ENGINE_DEATH = textwrap.dedent(
    """
    import logging, os, signal, sys
    from rollout import EngineConfig, RolloutEngine, SamplingParams
    from rollout.errors import EngineDeadError

    if __name__ == "__main__":
        with RolloutEngine(EngineConfig(model=sys.argv[1], executor="mp", num_workers=1)) as engine:
            os.kill(engine.executor.pids[0], signal.SIGKILL)
            try:
                engine.generate("x", SamplingParams(num_inference_steps=2))
            except EngineDeadError:
                pass
    """
)
LOG_LINES = textwrap.dedent(
    """
    import logging
    from executors import last_resort

    last_resort.install()  # as an engine's executor and workers do when they start
    logging.getLogger("executors.base").error("engine is dead: worker rank 0 (pid 1) died")
    logging.getLogger("rollout.worker.worker").info("below the last resort's level")
    logging.basicConfig(format="APP %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rollout.engine.rollout_engine").warning("after the application's own setup")
    """
)
FORMATTED = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ ERROR MainProcess executors\.base: engine is dead: worker rank 0")


def _stderr_lines(*command: str) -> list[str]:
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr.splitlines()


@pytest.mark.timeout(60)
def test_warnings_of_a_script_without_logging_setup_carry_a_format():
    lines = _stderr_lines("-c", LOG_LINES)
    assert len(lines) == 2 and FORMATTED.match(lines[0]), lines  # not the bare "engine is dead: ..."
    assert (
        lines[1] == "APP WARNING rollout.engine.rollout_engine: after the application's own setup"
    )  # once, the app's way


@pytest.mark.timeout(120)
@pytest.mark.slow  # an mp engine of its own (about 15 s); the mechanism is the test above
def test_a_dead_engine_in_a_script_without_logging_setup_says_so_with_a_format(tiny_model, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(ENGINE_DEATH)
    lines = _stderr_lines(str(script), tiny_model)
    assert any(FORMATTED.match(line) for line in lines), lines
    assert not any(line.startswith("engine is dead") for line in lines), lines
