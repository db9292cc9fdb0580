"""The CPU allocation high-water mark the memory tests and `rollout_throughput` read."""

from __future__ import annotations

import pytest
import torch

from benchmarks.allocation_peak import AllocationPeak

pytestmark = pytest.mark.timeout(60)


def test_the_peak_is_the_most_held_at_once_above_the_start():
    held_before = torch.empty(20_000_000, dtype=torch.uint8)
    with AllocationPeak() as peak:
        first = torch.empty(10_000_000, dtype=torch.uint8)
        second = torch.empty(5_000_000, dtype=torch.uint8)
        del first  # 5 MB held, 15 MB at most so far
        del held_before  # allocated before the start: its free does not count
        third = torch.empty(12_000_000, dtype=torch.uint8)  # 17 MB held
    assert peak.peak_bytes == 17_000_000
    del second, third
