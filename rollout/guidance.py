"""The guidance settings of a request, a trajectory or a batch of rows, as one value.

`SamplingParams` keeps the three fields of the diffusers pipelines' arguments (`guidance_scale`,
`guidance_scale_2`, `true_cfg_scale`); what a family makes of each is its adapter's (spec.py says
which it uses). From the request to the model runner, the adapter's `predict_velocity` and the
trainer's re-scoring they travel together as a `Guidance`, so a new field is added in one place.

torch is imported by the methods that make tensors: `SamplingParams` reads `GUIDANCE_FIELDS`, and a
recipe's config check runs without torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

Scale = "torch.Tensor | float | None"


class GuidanceSettings(Protocol):
    """Anything that carries the guidance fields: `SamplingParams`, `Trajectory`."""

    guidance_scale: float | None
    guidance_scale_2: float | None
    true_cfg_scale: float | None


@dataclass(frozen=True)
class Guidance:
    """Each field a float (every row alike) or a [B] float32 tensor (one per row); None where the
    model does not use it.

    guidance_scale: CFG scale (SD3, Wan, Z-Image), or the distilled guidance a transformer takes as an input
        (FLUX.1-dev); guidance_scale_2: Wan 2.2's CFG scale on its low-noise expert; true_cfg_scale:
        CFG scale of FLUX.1 and Qwen-Image (with a negative prompt).
    """

    guidance_scale: Scale = None
    guidance_scale_2: Scale = None
    true_cfg_scale: Scale = None

    @classmethod
    def of(cls, settings: GuidanceSettings) -> Guidance:
        """The guidance a request or a trajectory was sampled with (floats)."""
        return cls(**{name: getattr(settings, name) for name in GUIDANCE_FIELDS})

    @classmethod
    def per_row(cls, rows: Sequence[GuidanceSettings], device: torch.device | None = None) -> Guidance:
        """One [B] float32 tensor per field over `rows` (resolved requests of one model all set a
        field or all leave it None), on `device` (CPU by default), copied without waiting."""
        import torch

        from rollout.device_copy import host_to_device

        device = torch.device("cpu") if device is None else device
        values = {name: [getattr(row, name) for row in rows] for name in GUIDANCE_FIELDS}
        return cls(
            **{name: None if v[0] is None else host_to_device(v, device, torch.float32) for name, v in values.items()}
        )

    def rows(self, rows: Sequence[int]) -> Guidance:
        """The guidance of rows `rows` (host row numbers) of a batch: per-row fields indexed,
        floats as they are."""
        import torch

        from rollout.device_copy import row_index

        def picked(value: Scale) -> Scale:
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                return value[row_index(rows, value.shape[0], value.device)]
            return value

        return Guidance(**{name: picked(getattr(self, name)) for name in GUIDANCE_FIELDS})

    def expand(self, batch: int, device: torch.device) -> Guidance:
        """Every field that is set as a [batch] float32 tensor on `device`."""
        import torch

        def expanded(value: Scale) -> torch.Tensor | None:
            if value is None:
                return None
            return torch.as_tensor(value, dtype=torch.float32, device=device).expand(batch)

        return Guidance(**{name: expanded(getattr(self, name)) for name in GUIDANCE_FIELDS})


GUIDANCE_FIELDS = tuple(field.name for field in dataclasses.fields(Guidance))


def guidance_argument(guidance: Guidance | None, **fields: Scale) -> Guidance:
    """`guidance`, or a `Guidance` of the separate fields that callers passed before the three
    travelled together (`guidance_scale=...`); both at once is an error."""
    given = {name: value for name, value in fields.items() if value is not None}
    if guidance is not None and given:
        raise TypeError(f"pass the guidance as guidance=Guidance(...) or as {', '.join(given)}, not both")
    return guidance if guidance is not None else Guidance(**given)
