"""What the rollout service and its client send each other: safetensors, never pickle.

A body of tensors (weights, a LoRA adapter) is one safetensors file; its `__metadata__` carries
the small JSON a request needs beside the tensors (a LoRA's config).

Outputs travel as a stream of frames, so each one can go out as soon as it finishes. A frame is an
8-byte little-endian length, then a safetensors file whose metadata key "frame" holds JSON:
- {"kind": "requests", "request_ids": [...]}: the sample ids, first, in the order of the prompts;
- {"kind": "embeds", "key": ..., "class": ...}: one text's embeddings (a family's `PromptEmbeds`),
  a tensor per field; sent once per stream, before the first output that uses them (the samples of
  a prompt share them, as in process);
- {"kind": "part", "key": ...}: one part of a trajectory's `StepSeries` (the latents or a record),
  sent once per stream: the leaves of a tree rollout share the parts of their common history;
- {"kind": "output", ...}: one `RolloutOutput`: its id as data ("group_id", "sample_index",
  "branch_path", from which the decoder rebuilds its `NodeId`) and as text ("request_id", checked
  against them), its other fields, its tensors "image", "latents" and
  "trajectory.<field>", the keys of its condition's prompt and negative embeddings and encoded
  input images (an edit's, sent once per stream as an "embeds" frame too), and per series
  its positions (a tensor), its length and the keys of its parts;
- {"kind": "error", "type": ..., "message": ...}: the stream failed (the engine died).
A generate request with input images (an edit family's) is a safetensors body: its metadata
"request" holds the JSON body, and each image is a tensor "images.<prompt>.<k>": uint8 [3, H, W],
or a uint8 [N] tensor "images.<prompt>.<k>.png" holding a PNG file's bytes.
The same functions encode and decode, on both sides. Frames too big to copy whole (a full-weight
push) are written from and read into views by `rollout.http.frame_views`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from rollout.condition import Condition, PromptEmbeds
from rollout.http.tensor_bytes import (  # here too: the wire's own names
    LENGTH,
    SAFETENSORS_MEDIA_TYPE,  # noqa: F401 (the services read it from here)
    WireError,
    png_image,
    png_size,
    read_header,  # noqa: F401 (rollout.http.frame_views reads it from here)
    tensors_from_bytes,
    tensors_to_bytes,
)
from rollout.input_images import InputImages
from rollout.node_id import NodeId
from rollout.outputs import TRAJECTORY_SETTINGS, RequestTimings, RolloutOutput, Trajectory
from rollout.pipelines.families import FAMILIES
from rollout.step_series import StepSeries

FRAMES_MEDIA_TYPE = "application/x-rollout-frames"
# Trajectory fields that are tensors; the rest (TRAJECTORY_SETTINGS: sizes, sampler settings) travel as JSON.
_TRAJECTORY_TENSORS = ("log_probs", "timesteps", "sigmas", "sde_mask")


# Input images of a generate request.


def images_to_tensors(images: list[InputImages | None]) -> dict[str, torch.Tensor]:
    """Each prompt's input images as tensors "images.<prompt>.<k>" (uint8 [3, H, W])."""
    return {
        f"images.{p}.{k}": tensor
        for p, one in enumerate(images)
        if one is not None
        for k, tensor in enumerate(one.tensors)
    }


def named_images(tensors: Mapping[str, torch.Tensor], num_prompts: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The image tensors of a generate body, as (name, tensor) per prompt (empty for a prompt
    without images), in order; WireError names a tensor that is not an image of the protocol."""
    found: dict[int, dict[int, tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        png = len(parts) == 4 and parts[3] == "png"
        if parts[0] != "images" or len(parts) != (4 if png else 3) or not all(p.isdigit() for p in parts[1:3]):
            raise WireError(f"tensor {name!r} of a generate body is not an image; name them images.<prompt>.<k>[.png]")
        prompt, k = int(parts[1]), int(parts[2])
        if prompt >= num_prompts:
            raise WireError(f"tensor {name!r} is for prompt {prompt}, but the body has {num_prompts} prompts")
        found.setdefault(prompt, {})[k] = (name, tensor)
    named: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(num_prompts)]
    for prompt, by_index in found.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise WireError(f"the images of prompt {prompt} are numbered {sorted(by_index)}; number them from 0")
        named[prompt] = [by_index[k] for k in range(len(by_index))]
    return named


def image_sizes(named: list[list[tuple[str, torch.Tensor]]]) -> list[list[tuple[int, int]]]:
    """Every image's (height, width), per prompt, without decoding any: a PNG's from its header
    (a few KB of PNG can hold gigabytes of pixels), so that `RolloutEngine.check_requests` refuses
    what the engine would refuse before anything is decoded."""
    return [[_image_size(name, tensor) for name, tensor in one] for one in named]


def decode_images(named: list[list[tuple[str, torch.Tensor]]]) -> list[list[torch.Tensor] | None]:
    """The images of `named_images`, one list per prompt (None for a prompt without images): PNG
    files decoded, uint8 tensors as they are."""
    return [[png_image(t, n) if n.endswith(".png") else t for n, t in one] if one else None for one in named]


def _image_size(name: str, tensor: torch.Tensor) -> tuple[int, int]:
    """(height, width) of an image tensor of a generate body: a PNG file's from its header; a uint8
    [3, H, W] tensor's from its shape (one of another shape is refused by `InputImages` later)."""
    if name.endswith(".png"):
        return png_size(tensor, name)
    return (int(tensor.shape[-2]), int(tensor.shape[-1])) if tensor.ndim >= 2 else (0, 0)


# Frames.


def frame(
    kind: str, fields: Mapping[str, Any] | None = None, tensors: Mapping[str, torch.Tensor] | None = None
) -> bytes:
    """One frame: its length, then a safetensors file with `fields` (JSON) and `tensors`."""
    body = tensors_to_bytes(tensors or {}, {"frame": json.dumps({"kind": kind, **(fields or {})})})
    return LENGTH.pack(len(body)) + body


def error_frame(error: BaseException) -> bytes:
    return frame("error", {"type": type(error).__name__, "message": str(error)})


class FrameReader:
    """Splits a byte stream into frames: `feed(chunk)` yields each (fields, tensors) completed."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> Iterator[tuple[dict, dict[str, torch.Tensor]]]:
        self._buffer += chunk
        while len(self._buffer) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(self._buffer)
            end = LENGTH.size + length
            if len(self._buffer) < end:
                return
            body = bytes(self._buffer[LENGTH.size : end])
            del self._buffer[:end]
            tensors, metadata = tensors_from_bytes(body, "a frame")
            if "frame" not in metadata:
                raise WireError("a frame has no 'frame' metadata; is the server a rollout service?")
            yield json.loads(metadata["frame"]), tensors

    def close(self) -> None:
        if self._buffer:
            raise WireError(f"the stream ended inside a frame ({len(self._buffer)} bytes left over)")


# Outputs.


class OutputEncoder:
    """Encodes the outputs of one stream, sending each shared text embedding once."""

    def __init__(self):
        self._embeds_keys: dict[int, str] = {}  # id(PromptEmbeds) -> key sent
        self._part_keys: dict[int, str] = {}  # id(part tensor) -> key sent
        self._kept: list[PromptEmbeds | torch.Tensor] = []  # keeps those ids unique while the stream lives

    def encode(self, output: RolloutOutput) -> bytes:
        frames = b""
        fields = {
            name: getattr(output, name)
            for name in ("request_id", "group_id", "prompt", "prompt_index", "sample_index", "seed", "status", "error")
        }
        fields |= {
            "weight_version": output.weight_version,
            "weight_versions": list(output.weight_versions),
            "step_weight_versions": list(output.step_weight_versions),
            "lora": output.lora,
            "timings": dataclasses.asdict(output.timings),
            "branch_path": list(output.branch_path),
        }
        tensors = {}
        fields["audio_sample_rate"] = output.audio_sample_rate
        for name in ("image", "video", "latents", "audio"):
            if getattr(output, name) is not None:
                tensors[name] = getattr(output, name)
        trajectory = output.trajectory
        if trajectory is not None:
            values = {name: getattr(trajectory, name) for name in TRAJECTORY_SETTINGS}
            for part, embeds in trajectory.condition.parts().items():
                key = None
                if embeds is not None:
                    key, embeds_frame = self._embeds(embeds)
                    frames += embeds_frame
                values[part] = key
            series = {"latents": trajectory.latents} | trajectory.records
            values["series"] = {}
            for name, one in series.items():
                keys = []
                for part in one.parts:
                    key, part_frame = self._part(part)
                    frames += part_frame
                    keys.append(key)
                values["series"][name] = {"length": one.length, "parts": keys}
                tensors[f"trajectory.{name}.positions"] = one.positions
            fields["trajectory"] = values
            tensors |= {f"trajectory.{name}": getattr(trajectory, name) for name in _TRAJECTORY_TENSORS}
        return frames + frame("output", fields, tensors)

    def _part(self, part: torch.Tensor) -> tuple[str, bytes]:
        key, new = self._key(self._part_keys, "p", part)
        return key, frame("part", {"key": key}, {"part": part}) if new else b""

    def _embeds(self, embeds: PromptEmbeds) -> tuple[str, bytes]:
        key, new = self._key(self._embeds_keys, "e", embeds)
        if not new:
            return key, b""
        cls = type(embeds)
        return key, frame("embeds", {"key": key, "class": f"{cls.__module__}.{cls.__qualname__}"}, embeds.tensors())

    def _key(self, keys: dict[int, str], prefix: str, value: PromptEmbeds | torch.Tensor) -> tuple[str, bool]:
        """`value`'s key in this stream, and whether it is new (its frame still to send): the first
        time, a fresh one, and `value` kept so that its id is not reused while the stream lives."""
        key = keys.get(id(value))
        if key is not None:
            return key, False
        key = keys[id(value)] = f"{prefix}{len(keys)}"
        self._kept.append(value)
        return key, True


class OutputDecoder:
    """Decodes the frames of one stream back into `RolloutOutput`s (embeddings shared again)."""

    def __init__(self):
        self._embeds: dict[str, PromptEmbeds] = {}
        self._parts: dict[str, torch.Tensor] = {}

    def decode(self, fields: dict, tensors: dict[str, torch.Tensor]) -> RolloutOutput | None:
        """The output a frame completes, or None for a frame that only sets up later ones."""
        kind = fields["kind"]
        if kind == "embeds":
            self._embeds[fields["key"]] = _embeds_class(fields["class"])(**tensors)
            return None
        if kind == "part":
            self._parts[fields["key"]] = tensors["part"]
            return None
        if kind != "output":
            raise WireError(f"unexpected frame {kind!r} among outputs")
        trajectory = None
        if "trajectory" in fields:
            values = dict(fields["trajectory"])
            keys = {part: values.pop(part, None) for part in ("prompt", "negative", "images")}
            condition = Condition(**{part: None if key is None else self._embeds[key] for part, key in keys.items()})
            series = {
                name: StepSeries(
                    tensors[f"trajectory.{name}.positions"], [self._parts[key] for key in one["parts"]], one["length"]
                )
                for name, one in values.pop("series").items()
            }
            trajectory = Trajectory(
                **{name: tensors[f"trajectory.{name}"] for name in _TRAJECTORY_TENSORS},
                latents=series.pop("latents"),
                records=series,
                condition=condition,
                **values,
            )
        node_id = _node_id(fields)
        return RolloutOutput(
            node_id=node_id,
            prompt=fields["prompt"],
            prompt_index=fields["prompt_index"],
            seed=fields["seed"],
            status=fields["status"],
            image=tensors.get("image"),
            video=tensors.get("video"),
            latents=tensors.get("latents"),
            audio=tensors.get("audio"),
            audio_sample_rate=fields["audio_sample_rate"],
            trajectory=trajectory,
            weight_version=fields["weight_version"],
            weight_versions=tuple(fields["weight_versions"]),
            step_weight_versions=tuple(fields["step_weight_versions"]),
            lora=fields["lora"],
            timings=RequestTimings(**fields["timings"]),
            error=fields["error"],
        )


def _node_id(fields: dict) -> NodeId:
    """An output frame's id, from its parts; its text form must agree (else the peers differ in
    how they name samples)."""
    if "group_id" not in fields:
        raise WireError("an output frame has no group_id; is the server older than this client?")
    node_id = NodeId(fields["group_id"], fields["sample_index"], tuple(fields["branch_path"]))
    if str(node_id) != fields["request_id"]:
        raise WireError(
            f"an output frame's request_id {fields['request_id']!r} is not its group, sample and branch path "
            f"{str(node_id)!r}; are the server and this client different versions?"
        )
    return node_id


def _embeds_class(dotted: str) -> type[PromptEmbeds]:
    """A family's embeddings class by its dotted name; only classes in the families' modules qualify."""
    module_name, _, name = dotted.rpartition(".")
    family_modules = {family.adapter_class.rpartition(".")[0] for family in FAMILIES}
    if module_name not in family_modules:
        raise WireError(f"prompt embeddings class {dotted!r} is not in a family's module {sorted(family_modules)}")
    cls = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, PromptEmbeds)):
        raise WireError(f"{dotted!r} is not a prompt embeddings class; is this client older than the server?")
    return cls
