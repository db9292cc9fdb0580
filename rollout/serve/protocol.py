"""The JSON bodies of the rollout service's routes, as pydantic models.

Every body is strict: unknown fields are refused, numbers and booleans are not read from strings
(nor booleans as numbers), and NaN and infinity are refused in every float field.

Field names follow the post-training APIs people already use (sglang's `update_weights_from_disk`
takes `model_path`, vLLM's and sglang's LoRA routes take `lora_name` and `lora_path`). Tensors never
travel as JSON: see `rollout.http.wire`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from rollout.api import DEFAULT_BUCKET_BYTES, DEFAULT_COMPONENT
from rollout.engine.async_engine import PAUSE_MODES
from rollout.engine.weight_versions import MAX_VERSION, MIN_VERSION
from rollout.sampling_params import SamplingParams

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
Positive = Annotated[int, Field(gt=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]
# A weight version: a 64-bit signed integer, as every peer reads it (`rollout.engine.weight_versions`).
Version = Annotated[int, Field(ge=MIN_VERSION, le=MAX_VERSION)]


class Body(BaseModel):
    model_config = STRICT


def _sampling_params_model() -> type[BaseModel]:
    """A pydantic model with `SamplingParams`'s fields (types, defaults), so a wrong type or an
    unknown field is named before `SamplingParams` runs its own checks."""
    hints = typing.get_type_hints(SamplingParams)
    fields = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(SamplingParams)}
    return pydantic.create_model("SamplingParamsBody", __config__=STRICT, **fields)


SamplingParamsBody = _sampling_params_model()
# One params for every prompt, or a list with one per prompt. The discriminator picks the arm by the
# JSON's shape, so an error is reported against that arm only (its tag is left out of messages).
OneOrMoreParams = Annotated[
    Annotated[SamplingParamsBody, Tag("one")] | Annotated[list[SamplingParamsBody], Tag("per_prompt")],
    Discriminator(lambda value: "per_prompt" if isinstance(value, list) else "one"),
]
UNION_TAGS = ("one", "per_prompt")


def to_sampling_params(body: BaseModel) -> SamplingParams:
    return SamplingParams(**body.model_dump(exclude_unset=True))


class GenerateBody(Body):
    """`prompts` with one `params` for all or one per prompt, as `RolloutEngine.generate` takes them.
    With any of `request_id`, `prompt_index` and `base_seed` (one prompt only) it is `add_request`,
    and they mean what they mean there. `stream`: frames go out as each sample finishes, rather than
    all at the end."""

    prompts: str | list[str]
    params: OneOrMoreParams | None = None
    stream: bool = False
    request_id: str | None = None
    prompt_index: int = 0
    base_seed: int | None = None


class AbortBody(Body):
    request_ids: list[str]  # sample ids, or group ids (all their samples)


class PauseBody(Body):
    mode: Literal[PAUSE_MODES] = "abort"  # type: ignore[valid-type]


class UpdateFromTensorBody(Body):
    """The options of /update_weights_from_tensor, in its safetensors body's metadata "request"."""

    component: str = DEFAULT_COMPONENT
    version: Version | None = None
    mode: Literal["wait", "pause"] = "wait"
    check_finite: bool = True  # refuse NaN and infinity (the engine's default)
    bucket_bytes: Positive = DEFAULT_BUCKET_BYTES
    delta: bool = False  # the server's engine sends its workers only the tensors that changed


class LoadLoraTensorsBody(Body):
    """The options of /v1/load_lora_adapter with a safetensors body, in its metadata "request"."""

    lora_name: str
    lora_config: dict[str, Any]  # peft.LoraConfig as a dict (LoraConfig.to_dict(), sets as lists)
    version: Version | None = None
    check_finite: bool = True


class UpdateFromDiskBody(Body):
    model_path: str  # a .safetensors file or a diffusers component folder, on the server's machine
    component: str = DEFAULT_COMPONENT
    version: Version | None = None
    mode: Literal["wait", "pause"] = "wait"
    check_finite: bool = True


class UpdateFromWorkerBody(Body):
    """`update_weights_from_worker`: a `@stages_weights` function of the server's
    `--worker-extension-cls` by name, with JSON arguments."""

    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] | None = None
    component: str = DEFAULT_COMPONENT
    version: Version | None = None
    mode: Literal["wait", "pause"] = "wait"
    check_finite: bool = True


class LoadLoraBody(Body):
    lora_name: str
    lora_path: str  # a PEFT or diffusers LoRA folder on the server's machine
    version: Version | None = None
    check_finite: bool = True


class UnloadLoraBody(Body):
    lora_name: str


class ChecksumBody(Body):
    component: str = DEFAULT_COMPONENT


class ReleaseMemoryBody(Body):
    level: Literal[1, 2] = 1


class InitWeightUpdateGroupBody(Body):
    master_address: str
    master_port: Annotated[int, Field(ge=1, le=65535)]
    rank_offset: Positive
    world_size: Positive
    backend: str = "gloo"
    timeout_s: PositiveSeconds = 300.0


class UpdateFromDistributedBody(Body):
    names: list[str]
    dtypes: list[str]  # torch dtype names: "float32", "bfloat16", ...
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    component: str = DEFAULT_COMPONENT
    version: Version | None = None
    mode: Literal["wait", "pause"] = "wait"
    bucket_bytes: Positive = DEFAULT_BUCKET_BYTES
    check_finite: bool = True


class CheckWeightUpdateBody(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    component: str = DEFAULT_COMPONENT


class CollectiveRpcBody(Body):
    """A worker method by name (built in, or of the server's `--worker-extension-cls`); arguments
    and results are JSON. A callable cannot be sent."""

    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] | None = None
    timeout: PositiveSeconds | None = None
    ranks: list[Annotated[int, Field(ge=0)]] | None = None
