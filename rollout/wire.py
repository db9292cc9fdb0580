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
  "trajectory.<field>", the keys of its condition's prompt and negative embeddings, and per series
  its positions (a tensor), its length and the keys of its parts;
- {"kind": "error", "type": ..., "message": ...}: the stream failed (the engine died).
The same functions encode and decode, on both sides. Frames too big to copy whole (a full-weight
push) are written from and read into views by `rollout.frame_views`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import safetensors.torch
import torch

from rollout.node_id import NodeId
from rollout.outputs import TRAJECTORY_SETTINGS, RequestTimings, RolloutOutput, Trajectory
from rollout.pipelines.condition import Condition, PromptEmbeds
from rollout.pipelines.families import FAMILIES
from rollout.step_series import StepSeries

FRAMES_MEDIA_TYPE = "application/x-rollout-frames"
SAFETENSORS_MEDIA_TYPE = "application/octet-stream"
LENGTH = struct.Struct("<Q")  # a frame's length, and a safetensors header's
# Trajectory fields that are tensors; the rest (TRAJECTORY_SETTINGS: sizes, sampler settings) travel as JSON.
_TRAJECTORY_TENSORS = ("log_probs", "timesteps", "sigmas", "sde_mask")


class WireError(ValueError):
    """Bytes that are not what the protocol says (a malformed safetensors body or frame)."""


# Tensor bodies.


def tensors_to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors file of `tensors` (moved to CPU) with string `metadata`."""
    cpu = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    return safetensors.torch.save(cpu, metadata=dict(metadata) if metadata else None)


def tensors_from_bytes(data: bytes, what: str = "body") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file; WireError names `what` if it is not one."""
    metadata = _read_metadata(data, what)
    try:
        tensors = safetensors.torch.load(data)
    except Exception as error:  # safetensors raises its own SafetensorError (not a public class)
        raise WireError(f"{what} is not a valid safetensors file: {error}") from None
    return tensors, metadata


def _read_metadata(data: bytes, what: str) -> dict[str, str]:
    header, _ = read_header(data, what)
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def read_header(data, what: str) -> tuple[Any, int]:
    """A safetensors file's header (parsed JSON) and where its data starts in `data` (any buffer)."""
    if len(data) < LENGTH.size:
        raise WireError(f"{what} is not a valid safetensors file: {len(data)} bytes, shorter than its header")
    (header_length,) = LENGTH.unpack_from(data)
    if header_length > len(data) - LENGTH.size:
        raise WireError(f"{what} is not a valid safetensors file: its header runs past the end")
    try:
        header = json.loads(data[LENGTH.size : LENGTH.size + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"{what} is not a valid safetensors file: its header is not JSON ({error})") from None
    return header, LENGTH.size + header_length


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
            "lora": output.lora,
            "timings": dataclasses.asdict(output.timings),
            "branch_path": list(output.branch_path),
        }
        tensors = {}
        for name in ("image", "video", "latents"):
            if getattr(output, name) is not None:
                tensors[name] = getattr(output, name)
        trajectory = output.trajectory
        if trajectory is not None:
            values = {name: getattr(trajectory, name) for name in TRAJECTORY_SETTINGS}
            for part in ("prompt", "negative"):
                embeds = getattr(trajectory.condition, part)
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
        key = self._part_keys.get(id(part))
        if key is not None:
            return key, b""
        key = f"p{len(self._part_keys)}"
        self._part_keys[id(part)] = key
        self._kept.append(part)
        return key, frame("part", {"key": key}, {"part": part})

    def _embeds(self, embeds: PromptEmbeds) -> tuple[str, bytes]:
        key = self._embeds_keys.get(id(embeds))
        if key is not None:
            return key, b""
        key = f"e{len(self._embeds_keys)}"
        self._embeds_keys[id(embeds)] = key
        self._kept.append(embeds)
        cls = type(embeds)
        return key, frame("embeds", {"key": key, "class": f"{cls.__module__}.{cls.__qualname__}"}, embeds.tensors())


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
            prompt, negative = values.pop("prompt"), values.pop("negative")
            condition = Condition(self._embeds[prompt], self._embeds[negative] if negative is not None else None)
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
            trajectory=trajectory,
            weight_version=fields["weight_version"],
            weight_versions=tuple(fields["weight_versions"]),
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
    family_modules = {family.adapter.__module__ for family in FAMILIES}
    if module_name not in family_modules:
        raise WireError(f"prompt embeddings class {dotted!r} is not in a family's module {sorted(family_modules)}")
    cls = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, PromptEmbeds)):
        raise WireError(f"{dotted!r} is not a prompt embeddings class; is this client older than the server?")
    return cls
