"""Delta pushes: send only the tensors that changed since the version every replica holds.

The engine keeps, per component, the fingerprint of every tensor it sent (`SentRecord`) under the
version their commit made (a commit reaches every rank or none, so every replica holds it). A
push with `delta=True` fingerprints each given tensor and sends only those whose fingerprint
differs from the record's; the record is used only while the engine still holds its version
(any other update moves the version and makes the next delta push a full one), and is dropped
by `sleep`.

The fingerprint is CRC-32 of the bytes with the dtype and shape: one read pass (about 2.6 GB/s on
the benchmark's CPU, slower than a copy in memory, so delta pays where the link is slower than the
hash: another host, a server). A change that keeps a tensor's CRC-32 is missed with probability
2^-32 per changed tensor; `weights_checksum()` (SHA-256 of everything) is the exact check.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

Fingerprint = tuple[str, tuple[int, ...], int]  # dtype, shape, CRC-32 of the bytes


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    crc = zlib.crc32(data.view(torch.uint8).numpy()) if data.numel() else 0
    return str(tensor.dtype), tuple(tensor.shape), crc


@dataclass
class SentRecord:
    """The fingerprints of a component's tensors as of weight `version`."""

    version: int
    fingerprints: dict[str, Fingerprint] = field(default_factory=dict)


@dataclass(frozen=True)
class PushReport:
    """What one `update_weights` sent: of the `tensors` given (`nbytes` bytes, in the component's
    dtypes), `sent_tensors` (`sent_bytes`) crossed to the workers; a delta push skipped the rest."""

    tensors: int
    nbytes: int
    sent_tensors: int
    sent_bytes: int
    delta: bool

    @property
    def changed_fraction(self) -> float:
        """Bytes sent / bytes given (1.0 for a full push)."""
        return self.sent_bytes / self.nbytes if self.nbytes else 1.0
