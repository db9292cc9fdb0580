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
The same functions encode and decode, on both sides.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import safetensors.torch
import torch

from rollout.node_id import NodeId
from rollout.outputs import TRAJECTORY_SETTINGS, RequestTimings, RolloutOutput, Trajectory
from rollout.pipelines.condition import Condition, PromptEmbeds
from rollout.pipelines.families import FAMILIES
from rollout.safetensors_files import DTYPES
from rollout.step_series import StepSeries

FRAMES_MEDIA_TYPE = "application/x-rollout-frames"
SAFETENSORS_MEDIA_TYPE = "application/octet-stream"
_LENGTH = struct.Struct("<Q")
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
    header, _ = _read_header(data, what)
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def _read_header(data: bytes | bytearray, what: str) -> tuple[Any, int]:
    """A safetensors file's header (parsed JSON) and where its data starts."""
    if len(data) < _LENGTH.size:
        raise WireError(f"{what} is not a valid safetensors file: {len(data)} bytes, shorter than its header")
    (header_length,) = _LENGTH.unpack_from(data)
    if header_length > len(data) - _LENGTH.size:
        raise WireError(f"{what} is not a valid safetensors file: its header runs past the end")
    try:
        header = json.loads(data[_LENGTH.size : _LENGTH.size + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"{what} is not a valid safetensors file: its header is not JSON ({error})") from None
    return header, _LENGTH.size + header_length


# Frames.


def frame(
    kind: str, fields: Mapping[str, Any] | None = None, tensors: Mapping[str, torch.Tensor] | None = None
) -> bytes:
    """One frame: its length, then a safetensors file with `fields` (JSON) and `tensors`."""
    body = tensors_to_bytes(tensors or {}, {"frame": json.dumps({"kind": kind, **(fields or {})})})
    return _LENGTH.pack(len(body)) + body


def error_frame(error: BaseException) -> bytes:
    return frame("error", {"type": type(error).__name__, "message": str(error)})


class FrameReader:
    """Splits a byte stream into frames: `feed(chunk)` yields each (fields, tensors) completed."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> Iterator[tuple[dict, dict[str, torch.Tensor]]]:
        self._buffer += chunk
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                return
            body = bytes(self._buffer[_LENGTH.size : end])
            del self._buffer[:end]
            tensors, metadata = tensors_from_bytes(body, "a frame")
            if "frame" not in metadata:
                raise WireError("a frame has no 'frame' metadata; is the server a rollout service?")
            yield json.loads(metadata["frame"]), tensors

    def close(self) -> None:
        if self._buffer:
            raise WireError(f"the stream ended inside a frame ({len(self._buffer)} bytes left over)")


# Frames too big to copy whole (a body of weights, bucket by bucket): written in pieces that are
# views of the tensors' memory, and read into one buffer per frame that the tensors then view.

_DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
_PIECE_BYTES = 4 << 20  # what one write hands the connection: a bounded copy in the HTTP layer


def frame_pieces(
    kind: str, fields: Mapping[str, Any] | None = None, tensors: Mapping[str, torch.Tensor] | None = None
) -> Iterator[bytes | memoryview]:
    """`frame(kind, fields, tensors)` in pieces, with no copy of a CPU tensor's bytes: the length
    and header, then views of each tensor's memory (at most 4 MiB each)."""
    cpu = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in (tensors or {}).items()]
    cpu.sort(key=lambda item: -item[1].element_size())  # every tensor's offset a multiple of its element size
    header: dict[str, Any] = {"__metadata__": {"frame": json.dumps({"kind": kind, **(fields or {})})}}
    size = 0
    for name, tensor in cpu:
        if tensor.dtype not in _DTYPE_CODES:
            raise WireError(
                f"{name}: dtype {tensor.dtype} has no safetensors code; send one of {sorted(map(str, _DTYPE_CODES))}"
            )
        header[name] = {
            "dtype": _DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [size, size + tensor.nbytes],
        }
        size += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-aligned, as safetensors writes it
    yield _LENGTH.pack(_LENGTH.size + len(encoded) + size) + _LENGTH.pack(len(encoded)) + encoded
    for _, tensor in cpu:
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # bfloat16 too: as bytes
        for start in range(0, len(data), _PIECE_BYTES):
            yield data[start : start + _PIECE_BYTES]


class FrameAssembler:
    """Cuts a byte stream into frames as it arrives: each frame's bytes are copied once, into a
    bytearray of its own (see `tensors_from_buffer`). `feed(chunk)` yields each frame completed;
    `close()` raises if the stream ended inside one. A frame longer than `max_frame_bytes` is a
    `FrameTooLarge` as soon as its length arrives."""

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self._length = bytearray()  # the length of the next frame, as it arrives
        self._frame: bytearray | None = None
        self._filled = 0

    def feed(self, chunk: bytes) -> Iterator[bytearray]:
        view = memoryview(chunk)
        while view or (self._frame is not None and self._filled == len(self._frame)):
            if self._frame is None:
                taken = _LENGTH.size - len(self._length)
                self._length += view[:taken]
                view = view[taken:]
                if len(self._length) < _LENGTH.size:
                    return
                (length,) = _LENGTH.unpack(self._length)
                self._length.clear()
                if length > self.max_frame_bytes:
                    raise FrameTooLarge(f"a frame of {length} bytes is over the limit of {self.max_frame_bytes}")
                self._frame, self._filled = bytearray(length), 0
            taken = min(len(view), len(self._frame) - self._filled)
            self._frame[self._filled : self._filled + taken] = view[:taken]
            self._filled += taken
            view = view[taken:]
            if self._filled == len(self._frame):
                done, self._frame = self._frame, None
                yield done

    def close(self) -> None:
        if self._length or self._frame is not None:
            held = len(self._length) + self._filled
            raise WireError(f"the stream ended inside a frame ({held} bytes of it arrived)")


class FrameTooLarge(WireError):
    """A frame announces more bytes than the reader takes."""


def tensors_from_buffer(buffer: bytearray, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a safetensors file held in `buffer`, as views of it (no copy), and its frame
    fields (metadata "frame", JSON). WireError names `what` if the file is malformed."""
    header, start = _read_header(buffer, what)
    if not isinstance(header, dict):
        raise WireError(f"{what} is not a valid safetensors file: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    try:
        fields = json.loads(metadata["frame"])
        entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    except (KeyError, TypeError, IndexError, json.JSONDecodeError) as error:
        raise WireError(f"{what} has no valid 'frame' metadata or tensor offsets ({error!r})") from None
    tensors, end = {}, 0
    for name, entry in entries:
        tensors[name] = _tensor_view(buffer, start, end, name, entry, what)
        end = entry["data_offsets"][1]
    if start + end != len(buffer):
        raise WireError(
            f"{what} is not a valid safetensors file: its tensors end at byte {start + end} of {len(buffer)}"
        )
    return tensors, fields


def _tensor_view(buffer: bytearray, start: int, end: int, name: str, entry: Any, what: str) -> torch.Tensor:
    """Tensor `name` of a safetensors buffer, whose previous tensor ended at data byte `end`."""
    try:
        dtype, shape, (first, last) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        if not all(isinstance(n, int) and n >= 0 for n in (*shape, first, last)):
            raise ValueError("negative or non-integer sizes")
    except (KeyError, TypeError, ValueError) as error:
        raise WireError(f"{what}: tensor {name!r} has a malformed entry {entry!r} ({error!r})") from None
    numel = math.prod(shape)
    if first != end or last - first != numel * dtype.itemsize or start + last > len(buffer):
        raise WireError(
            f"{what}: tensor {name!r} ({entry['dtype']} {shape}) does not fit its data offsets {[first, last]}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=numel, offset=start + first).view(shape)


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
