"""What a reward worker and the reward service are sent and answer: safetensors and JSON, never pickle.

A group to score is one safetensors file (the pipe of a reward worker and the body of the reward
service's POST /score take the same bytes):
- "images": uint8 [N, 3, H, W] (or videos [N, F, 3, H, W]); or, per sample i, "images.<i>.png": a
  uint8 [bytes] tensor holding a PNG file;
- "input_images.<j>": uint8 [3, H, W] (or "input_images.<j>.png"): the input images of an edit,
  each sent once however many samples name it;
- metadata "request": JSON {"prompts": [N texts], "metadata": [N objects]} (metadata optional: N
  empty objects). A sample's "input_images" is a list of the names of its input-image tensors, or
  null; "branch_path" comes back as a tuple, as the rollout gives it; a sample's "audio" (a video
  with sound) is the name of its float32 [channels, samples] tensor "audio.<i>". Every other value
  is plain JSON.
Scores go back as a safetensors file of "total" and "components.<name>" ([N] float32, bit for bit)
to the trainer, and as JSON {"total": [...], "components": {name: [...]}} from the service.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from rollout.http.tensor_bytes import WireError, png_image, tensors_from_bytes, tensors_to_bytes
from trainers_adapters.rewards.composite import RewardScores

_INPUT = "input_images"
_AUDIO = "audio"


def encode_group(images, prompts: Sequence[str], metadata: Sequence[dict]) -> bytes:
    """The safetensors bytes of one group (see the module's docstring); images uint8 [N, 3, H, W],
    [N, F, 3, H, W] or a list of [3, H, W]."""
    images = torch.stack(list(images)) if not isinstance(images, torch.Tensor) else images
    tensors = {"images": images}
    named: dict[int, str] = {}  # id of an input-image tensor -> its name: a group's samples share them
    rows = []
    for row, meta in enumerate(metadata):
        meta = dict(meta)
        if meta.get(_AUDIO) is not None:
            tensors[f"{_AUDIO}.{row}"] = meta[_AUDIO]
            meta[_AUDIO] = f"{_AUDIO}.{row}"
        inputs = meta.get(_INPUT)
        if inputs is not None:
            names = []
            for tensor in inputs:
                if id(tensor) not in named:
                    named[id(tensor)] = f"{_INPUT}.{len(named)}"
                    tensors[named[id(tensor)]] = tensor
                names.append(named[id(tensor)])
            meta[_INPUT] = names
        rows.append(meta)
    try:
        request = json.dumps({"prompts": list(prompts), "metadata": rows})
    except TypeError as error:
        raise WireError(
            f"a reward's metadata must be plain JSON values (numbers, texts, lists) besides input_images: {error}"
        ) from None
    return tensors_to_bytes(tensors, {"request": request})


def decode_group(data: bytes, max_images: int | None = None) -> tuple[torch.Tensor, list[str], list[dict]]:
    """(images, prompts, metadata) of `encode_group`'s bytes (or a client's body in that form);
    WireError says what is wrong with them. `max_images`: the most samples accepted."""
    tensors, header = tensors_from_bytes(data, "the group's body")
    try:
        request = json.loads(header.get("request", "null"))
    except json.JSONDecodeError as error:
        raise WireError(f"the body's metadata 'request' is not JSON: {error}") from None
    if not isinstance(request, dict) or not isinstance(request.get("prompts"), list):
        raise WireError('the body\'s metadata "request" must be JSON {"prompts": [...], "metadata": [...]}')
    prompts = request["prompts"]
    if not all(isinstance(prompt, str) for prompt in prompts):
        raise WireError("request.prompts must be a list of texts, one per image")
    count = len(prompts)
    if max_images is not None and count > max_images:
        raise WireError(f"the body has {count} images; this service scores at most {max_images} per request")
    metadata = request.get("metadata", [{}] * count)
    if not isinstance(metadata, list) or len(metadata) != count or not all(isinstance(m, dict) for m in metadata):
        raise WireError(f"request.metadata must be a list of {count} objects, one per prompt")
    images = _images(tensors, count)
    inputs = {name: _image(tensor, name) for name, tensor in tensors.items() if name.startswith(_INPUT + ".")}
    prefixes = ("images.", _INPUT + ".", _AUDIO + ".")
    unknown = [name for name in tensors if name != "images" and not name.startswith(prefixes)]
    if unknown:
        raise WireError(f"tensors {unknown} are neither images, input_images nor audio; see the body's format")
    for row, meta in enumerate(metadata):
        if "branch_path" in meta and isinstance(meta["branch_path"], list):
            meta["branch_path"] = tuple(meta["branch_path"])
        names = meta.get(_INPUT)
        if names is not None:
            missing = [name for name in names if name not in inputs] if isinstance(names, list) else [names]
            if missing:
                raise WireError(f"metadata[{row}].input_images names {missing}, which are not tensors of the body")
            meta[_INPUT] = [inputs[name] for name in names]
        if meta.get(_AUDIO) is not None:
            meta[_AUDIO] = _audio(tensors, meta[_AUDIO], row)
    return images, prompts, metadata


def _audio(tensors: dict[str, torch.Tensor], name, row: int) -> torch.Tensor:
    audio = tensors.get(name) if isinstance(name, str) and name.startswith(_AUDIO + ".") else None
    if audio is None:
        raise WireError(f"metadata[{row}].audio names {name!r}, which is not an audio tensor of the body")
    if audio.dtype != torch.float32 or audio.ndim != 2:
        raise WireError(
            f"tensor {name!r} must be a float32 [channels, samples] waveform, got {audio.dtype} {list(audio.shape)}"
        )
    return audio


def _images(tensors: dict[str, torch.Tensor], count: int) -> torch.Tensor:
    if "images" in tensors:
        images = tensors["images"]
        if images.dtype != torch.uint8 or images.ndim not in (4, 5) or images.shape[-3] != 3 or len(images) != count:
            raise WireError(
                f"tensor 'images' must be uint8 [{count}, 3, H, W] (or videos [{count}, F, 3, H, W]), one per "
                f"prompt, got {images.dtype} {list(images.shape)}"
            )
        return images
    names = [f"images.{i}.png" for i in range(count)]
    missing = [name for name in names if name not in tensors]
    if missing:
        raise WireError(f"the body has no tensor 'images' and misses PNG images {missing[:5]}; send one per prompt")
    decoded = [png_image(tensors[name], name) for name in names]
    sizes = {tuple(image.shape) for image in decoded}
    if len(sizes) > 1:
        raise WireError(f"the PNG images have different sizes {sorted(sizes)}; a group's images share one size")
    return torch.stack(decoded) if decoded else torch.zeros(0, 3, 1, 1, dtype=torch.uint8)


def _image(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if name.endswith(".png"):
        return png_image(tensor, name)
    if tensor.dtype != torch.uint8 or tensor.ndim != 3 or tensor.shape[0] != 3:
        raise WireError(f"tensor {name!r} must be uint8 [3, H, W], got {tensor.dtype} {list(tensor.shape)}")
    return tensor


def encode_scores(scores: RewardScores) -> bytes:
    tensors = {"total": scores.total, **{f"components.{name}": value for name, value in scores.components.items()}}
    return tensors_to_bytes(tensors, {"components": json.dumps(list(scores.components))})


def decode_scores(data: bytes) -> RewardScores:
    tensors, header = tensors_from_bytes(data, "a reward worker's scores")
    names = json.loads(header["components"])  # in the reward's order (safetensors sorts its tensors)
    return RewardScores(total=tensors["total"], components={name: tensors[f"components.{name}"] for name in names})


def scores_to_json(scores: RewardScores) -> dict:
    """The service's answer: float32 values as JSON numbers (a double holds each exactly)."""
    return {
        "total": scores.total.tolist(),
        "components": {name: value.tolist() for name, value in scores.components.items()},
    }


def scores_from_json(answer: dict) -> RewardScores:
    return RewardScores(
        total=torch.tensor(answer["total"], dtype=torch.float32),
        components={name: torch.tensor(v, dtype=torch.float32) for name, v in answer["components"].items()},
    )
