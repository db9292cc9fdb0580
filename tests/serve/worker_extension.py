"""Worker functions the service tests call by name over HTTP (a callable cannot cross HTTP)."""

from __future__ import annotations

import functools
import os
import time

from safetensors import safe_open

from rollout.worker.marks import read_only, stages_weights


class ServeTestExtension:
    step_delay_s = 0.0
    failing_prompts: frozenset[str] = frozenset()

    def fail_prompt(self, prompt: str | None) -> None:
        """From now on a step of a batch that holds a request for `prompt` raises in its forward
        pass, as a request the model cannot take makes it; None stops that."""
        if "failing_prompts" not in vars(self):
            step = self.runner.step

            def failing_step(states):
                if any(state.data.prompt in self.failing_prompts for state in states):
                    raise RuntimeError(f"injected failure for one of {sorted(self.failing_prompts)}")
                step(states)

            self.runner.step = failing_step
        self.failing_prompts = frozenset() if prompt is None else frozenset({prompt})

    @read_only
    def pid(self) -> int:
        return os.getpid()

    def set_step_delay(self, seconds: float) -> None:
        """Make every later denoising step of this worker take `seconds` longer (0: back to normal)."""
        wrapped = "step_delay_s" in vars(self)  # set on the first call, with the wrapper below
        self.step_delay_s = seconds
        if not wrapped:
            step = self.runner.step

            def slow_step(states):
                time.sleep(self.step_delay_s)
                step(states)

            self.runner.step = slow_step

    @stages_weights
    def weights_from_file(self, path: str, fail_after: int | None = None):
        """The tensors of a safetensors file on the server's machine, one at a time; with
        `fail_after`, raise once that many are yielded (a transport that breaks mid-update)."""
        with safe_open(path, "pt") as weights:
            for index, name in enumerate(weights.keys()):
                if index == fail_after:
                    raise ConnectionError(f"the transport broke after {index} tensors")
                yield name, weights.get_tensor(name)

    def set_marker(self, value: str) -> None:
        """Changes the worker (not marked read-only, and not opened with --rpc-allow)."""
        self.marker = value

    def raise_key_error(self, key: str) -> None:
        """A worker function that fails as a user's may (not a ValueError)."""
        raise KeyError(key)

    def health_checks(self) -> int:
        """How many times the engine has checked this worker's health since the first call of this
        (the executor calls the class's method by name, so the class's is wrapped)."""
        if "health_checks_run" not in vars(self):
            self.health_checks_run = 0
            worker_class, check = type(self), type(self).check_health

            @functools.wraps(check)  # its @read_only mark too
            def counted_check(worker):
                worker.health_checks_run += 1
                return check(worker)

            worker_class.check_health = counted_check
        return self.health_checks_run
