"""Per-sample seeds that depend only on (base seed, prompt index, sample index, stream).

A sample's noise therefore never depends on which other requests share its batch or in which
order the scheduler runs them.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

_MASK_63 = (1 << 63) - 1


def derive_seed(base_seed: int, prompt_index: int, sample_index: int, stream: str) -> int:
    """A 63-bit seed mixed from its inputs; `stream` separates initial noise from step noise."""
    key = f"{base_seed}:{prompt_index}:{sample_index}:{stream}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _MASK_63


def fresh_base_seed() -> int:
    return secrets.randbits(63)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator: CPU draws are identical on every device, so results reproduce across them."""
    return torch.Generator(device="cpu").manual_seed(seed)
