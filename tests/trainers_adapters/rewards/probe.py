"""A reward the reward-worker and reward-service tests steer through each sample's metadata:
"started" (a file it creates when it starts scoring), "sleep_s" (how long it then takes), "nan"
(return NaN for that sample), "device_to" (a file it writes its `device` setting to). Otherwise it
scores each image's mean brightness in [0, 1]."""

from __future__ import annotations

import time
from pathlib import Path

import torch


class Probe:
    def __init__(self, fail_to_build: bool = False, device: str = "cpu"):
        if fail_to_build:
            raise ValueError("Probe was told to fail (fail_to_build)")
        self.device = device

    def __call__(self, images, prompts, metadata):
        if metadata and metadata[0].get("started"):
            Path(metadata[0]["started"]).touch()
        if metadata and metadata[0].get("device_to"):
            Path(metadata[0]["device_to"]).write_text(str(self.device))
        time.sleep(max((m.get("sleep_s", 0.0) for m in metadata), default=0.0))
        scores = images.float().mean(dim=tuple(range(1, images.ndim))) / 255
        return torch.where(torch.tensor([bool(m.get("nan")) for m in metadata]), torch.nan, scores)
