"""The rollout service's route table: what the server serves and what the client calls, once.

Each route is named by the `RolloutAPI` method it carries (plus the service's own: health,
server_info, pause, resume): its path, the pydantic model of its body (for a safetensors body, of the
options in its metadata "request"), and the field of the JSON answer that the client returns. The
server (`app.py`) mounts its handlers on these paths; the client (`client.py`) builds its bodies from
these models, so a field's name and default exist once.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rollout.serve import protocol


@dataclass(frozen=True)
class Route:
    path: str
    body: type[BaseModel] | None = None  # None: no body
    answer: str | None = None  # the answer's field the client returns (None: nothing, or frames)
    method: str = "POST"


ROUTES: dict[str, Route] = {
    "health": Route("/health", method="GET"),
    "server_info": Route("/server_info", method="GET"),
    "generate": Route("/rollout/generate", protocol.GenerateBody),  # answers frames (rollout.http.wire)
    "abort": Route("/abort_requests", protocol.AbortBody),  # answers frames
    "pause": Route("/pause", protocol.PauseBody),
    "resume": Route("/resume"),
    "update_weights": Route("/update_weights_from_tensor", protocol.UpdateFromTensorBody, "weight_version"),
    "update_weights_from_disk": Route("/update_weights_from_disk", protocol.UpdateFromDiskBody, "weight_version"),
    "update_weights_from_worker": Route(
        "/update_weights_from_worker", protocol.UpdateFromWorkerBody, "weight_version"
    ),
    "weights_checksum": Route("/get_weights_checksum", protocol.ChecksumBody, "checksum"),
    "load_lora": Route("/v1/load_lora_adapter", protocol.LoadLoraBody, "weight_version"),
    "load_lora_tensors": Route("/v1/load_lora_adapter", protocol.LoadLoraTensorsBody, "weight_version"),
    "unload_lora": Route("/v1/unload_lora_adapter", protocol.UnloadLoraBody),
    "sleep": Route("/release_memory_occupation", protocol.ReleaseMemoryBody),
    "wake_up": Route("/resume_memory_occupation"),
    "init_weight_update_group": Route("/init_weight_update_group", protocol.InitWeightUpdateGroupBody, "group_ranks"),
    "update_weights_from_distributed": Route(
        "/update_weights_from_distributed", protocol.UpdateFromDistributedBody, "weight_version"
    ),
    "check_weight_update": Route("/check_weight_update", protocol.CheckWeightUpdateBody),
    "collective_rpc": Route("/collective_rpc", protocol.CollectiveRpcBody, "results"),
}


def path(name: str) -> str:
    return ROUTES[name].path


def body_json(name: str, **fields) -> dict:
    """The JSON body of route `name`: `fields` (JSON values) and the model's defaults for the rest.
    The server checks the values; a field the model does not have is a TypeError here."""
    model = ROUTES[name].body
    unknown = sorted(set(fields) - set(model.model_fields))
    if unknown:
        raise TypeError(f"{model.__name__} has no fields {unknown}")
    defaults = {name: f.get_default(call_default_factory=True) for name, f in model.model_fields.items()}
    return {name: value for name, value in defaults.items() if value is not PydanticUndefined} | fields
