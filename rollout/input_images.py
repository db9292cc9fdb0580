"""Input images of an edit request: checked once at admission, then carried as data.

A request of an edit family (FLUX.1 Kontext, ...) carries the images its pipeline takes as
`image=`: a list per prompt of uint8 [3, H, W] tensors or PIL images. They are held here as uint8
[3, H, W] CPU tensors (a PIL image converts losslessly), with a digest of their bytes: the worker
encodes the images of one digest once, and the engine shares the encoded latents of one digest
between the samples of every prompt that sent them, as it shares text embeddings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class InputImages(Sequence):
    """One prompt's input images: uint8 [3, H, W] CPU tensors, in the order the pipeline takes them
    (a sequence of them, so it is itself what `images=` takes)."""

    tensors: tuple[torch.Tensor, ...]
    # SHA-256 over every image's shape and bytes, and `encoding`: equal digests, equal encodings.
    digest: str
    # The request's settings that change how its family encodes these images (FLUX.1 Kontext's
    # auto_resize), as (name, value) pairs, so that the encoding's caches and batches tell them apart.
    encoding: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, images: Sequence, where: str = "images") -> InputImages:
        """Check and convert one prompt's images (a list of uint8 [3, H, W] tensors or PIL images;
        a single image is taken as a list of one). `where` names them in errors."""
        if isinstance(images, torch.Tensor) or _is_pil(images):
            images = [images]
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise TypeError(
                f"{where} must be a list of images (uint8 [3, H, W] tensors or PIL images), "
                f"got {type(images).__name__}"
            )
        if len(images) == 0:
            raise ValueError(f"{where} is an empty list; pass at least one image, or None for a text-only request")
        tensors = tuple(_as_uint8(image, f"{where}[{i}]") for i, image in enumerate(images))
        digest = hashlib.sha256()
        for tensor in tensors:
            digest.update(repr(tuple(tensor.shape)).encode())
            digest.update(tensor.numpy().tobytes())
        return cls(tensors, digest.hexdigest())

    def encoded_with(self, **settings) -> InputImages:
        """The same images, to be encoded with these settings (read by the family's encoder)."""
        encoding = tuple(sorted(settings.items()))
        if encoding == self.encoding:
            return self
        digest = hashlib.sha256(f"{self.digest}|{encoding!r}".encode()).hexdigest()
        return InputImages(self.tensors, digest, encoding)

    def setting(self, name: str, default):
        """One of the `encoding` settings, or `default` where the request gave none."""
        return dict(self.encoding).get(name, default)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, index):
        return self.tensors[index]

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) of each image, in pixels."""
        return tuple((int(t.shape[1]), int(t.shape[2])) for t in self.tensors)

    def pil(self) -> list:
        """The images as RGB PIL images (what the diffusers pipelines' image processors resize)."""
        from PIL import Image

        return [Image.fromarray(t.permute(1, 2, 0).contiguous().numpy(), mode="RGB") for t in self.tensors]


def images_per_prompt(images, num_prompts: int) -> list[InputImages | None]:
    """`generate(..., images=)` checked: None (no prompt has images), or one entry per prompt, each
    a list of images (or None: that prompt is text-only)."""
    if images is None:
        return [None] * num_prompts
    if isinstance(images, torch.Tensor) or _is_pil(images) or not isinstance(images, Sequence):
        raise TypeError(
            "images must be a list with one entry per prompt (each a list of uint8 [3, H, W] tensors or "
            f"PIL images, or None), got {type(images).__name__}; for one prompt pass images=[[image]]"
        )
    if len(images) != num_prompts:
        raise ValueError(f"got images for {len(images)} prompts but {num_prompts} prompts; pass one list per prompt")
    return [None if one is None else InputImages.of(one, f"images[{i}]") for i, one in enumerate(images)]


def _is_pil(value) -> bool:
    return type(value).__module__.startswith("PIL.")


def _as_uint8(image, where: str) -> torch.Tensor:
    if _is_pil(image):
        import numpy as np

        array = np.asarray(image.convert("RGB"))
        return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"{where} must be a uint8 [3, H, W] tensor or a PIL image, got {type(image).__name__}")
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(
            f"{where} must be uint8 [3, H, W] (RGB, channels first), got {image.dtype} {list(image.shape)}; "
            "convert a float image in [0, 1] with (image * 255).round().to(torch.uint8)"
        )
    if image.shape[1] == 0 or image.shape[2] == 0:
        raise ValueError(f"{where} is empty ({list(image.shape)})")
    return image.detach().to("cpu").contiguous()
