"""Input images for a tiny edit recipe: a coloured shape on a background, one per prompt, drawn
from a seed (so a run, its eval and a resumed run edit the same images)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from recipes.config import option

if TYPE_CHECKING:
    import torch

SOURCES = ("shapes",)


@dataclass(kw_only=True)
class InputImagesSection:
    """The input images of an edit recipe's prompts (an edit family's model: flux_kontext, flux2_klein)."""

    source: str | None = option(
        None, "null: text-only prompts; shapes: each prompt edits its own generated image of a coloured shape"
    )
    height: int = option(32, "the generated images' height in pixels (an edit is made at its input's size)")
    width: int = option(32, "the generated images' width in pixels")
    seed: int = option(0, "seed of the generated images")

    def __post_init__(self) -> None:
        problems = []
        if self.source is not None and self.source not in SOURCES:
            problems.append(f"input_images.source must be null or one of {list(SOURCES)}, got {self.source!r}")
        for name in ("height", "width"):
            if getattr(self, name) < 8:
                problems.append(f"input_images.{name} must be >= 8 pixels, got {getattr(self, name)}")
        if problems:
            raise ValueError("; ".join(problems))

    def for_prompts(self, prompts: list[str]) -> dict[str, list[torch.Tensor]] | None:
        """Prompt -> its input images (a list of one uint8 [3, H, W]), or None without a source."""
        if self.source is None:
            return None
        return {prompt: [shape_image(self.seed, i, self.height, self.width)] for i, prompt in enumerate(prompts)}


def shape_image(seed: int, index: int, height: int, width: int) -> torch.Tensor:
    """uint8 [3, H, W]: a square or a disc of one colour on a background of another, its size and
    place drawn from (seed, index)."""
    import torch  # here, not with the section: a recipe's config is checked without torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    background, colour = torch.randint(0, 256, (2, 3), generator=generator).to(torch.uint8)
    size = int(torch.randint(min(height, width) // 3, min(height, width) * 2 // 3 + 1, (), generator=generator))
    top = int(torch.randint(0, height - size + 1, (), generator=generator))
    left = int(torch.randint(0, width - size + 1, (), generator=generator))
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    if int(torch.randint(0, 2, (), generator=generator)):
        inside = (rows >= top) & (rows < top + size) & (cols >= left) & (cols < left + size)
    else:
        centre_row, centre_col, radius = top + size / 2, left + size / 2, size / 2
        inside = (rows + 0.5 - centre_row) ** 2 + (cols + 0.5 - centre_col) ** 2 <= radius**2
    image = background.view(3, 1, 1).expand(3, height, width).clone()
    image[:, inside] = colour.view(3, 1)
    return image
