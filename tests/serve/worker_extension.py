"""Worker functions the service tests call by name over HTTP (a callable cannot cross HTTP)."""

from __future__ import annotations

import os
import time


class ServeTestExtension:
    step_delay_s = 0.0

    def pid(self) -> int:
        return os.getpid()

    def set_step_delay(self, seconds: float) -> None:
        """Make every later denoising step of this worker take `seconds` longer (0: back to normal)."""
        wrapped = "step" in vars(self.runner)  # the instance attribute is the wrapper below
        self.step_delay_s = seconds
        if not wrapped:
            step = self.runner.step

            def slow_step(states):
                time.sleep(self.step_delay_s)
                step(states)

            self.runner.step = slow_step
