"""The memory plan of a training config (`python -m recipes.run CONFIG --plan`), computed before
anything loads: per device, the weights (the engine's, the trainer's and what they share), the
LoRA with its gradients and AdamW states, and the activation peak of one training micro-batch.

Weights: every module of the model folder built on the meta device from its `model_index.json`
and each component's `config.json` (no weight file is read), counted at the config's dtype. Where
`model.path` is not a folder here (a real-size config planned on a laptop), the family that
`model.tiny_family` names builds its "real" preset in memory on the meta device instead: the
published transformer config, and one-layer stand-ins for the text encoders and VAE, which count
at the published sizes the family declares (`Family.published_parts`; the printout says which). LoRA:
the trainer's adapter attached to those meta denoisers (float32, as it trains), its gradients
(float32) and AdamW's two float32 states per parameter. Activations: `train_step_peak` on
`FakeTensorMode`'s shape-only tensors over the same meta model (the trainer's forward and
backward at the config's micro-batch, size, frames and guidance; gradient checkpointing as the
trainer sets it), which costs no memory at any size.

Placements (`trainer.placement`): colocated, each device holds one engine and one trainer rank
that shares the engine's frozen denoisers; separate, an engine device holds the engine only and a
trainer device the trainer, with its own copy of the denoisers (no text encoders, no VAE). The
engine's own sampling activations are not planned (a rollout runs without gradients, and
`engine.max_batch_size` bounds it). A full policy (`policy: full`) is planned sharded over the
trainer ranks (`full_policy_plan`).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from rollout.pipelines.compiled_blocks import repeated_block_classes
from rollout.pipelines.families import family_named
from rollout.pipelines.loading import adapter_class
from rollout.pipelines.model_index import read_model_index
from rollout.pipelines.quiet import quietly
from rollout.pipelines.tiny.saving import InMemory

GIB = 1024**3
ADAMW_STATES = 2  # exp_avg and exp_avg_sq, float32, per trained parameter


@quietly
def meta_adapter(folder: str | Path, dtype: torch.dtype):
    """The family's `PipelineAdapter` over the pipeline of `folder` with every module made on the
    meta device from its config.json, in `dtype` (tokenizers and the scheduler read as they are:
    small files)."""
    import diffusers

    folder = Path(folder)
    index = read_model_index(folder)
    components = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list):
            continue
        library, class_name = value
        if library is None:  # a component saved as [null, null] (SD3 without T5)
            components[name] = None
            continue
        cls = getattr(importlib.import_module(library), class_name)
        if not issubclass(cls, torch.nn.Module):
            components[name] = cls.from_pretrained(folder / name)
        elif library == "diffusers":
            with torch.device("meta"):
                components[name] = in_dtype(cls.from_config(cls.load_config(folder / name)), dtype)
        else:  # transformers
            config = cls.config_class.from_pretrained(folder / name)
            with torch.device("meta"):
                components[name] = in_dtype(cls._from_config(config), dtype)
    pipeline = getattr(diffusers, index["_class_name"])(**components)
    return adapter_class(index["_class_name"])(pipeline)


def in_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` cast to `dtype`; not cast when already in it (diffusers warns on every cast)."""
    return module if dtype == torch.float32 else module.to(dtype)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (meta tensors count their shapes and dtypes)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def size(count: int) -> str:
    """Bytes as GiB from 1 GiB up, else MiB."""
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 1024**2:.2f} MiB"


# When a line is on the device: throughout, or only while the engine samples (its weights, with
# `trainer.engine_sleep`) or while the trainer updates (gradients, gathered units, activations).
THROUGHOUT, SAMPLING, TRAINING = "", "sampling", "training"


@dataclass(frozen=True)
class Line:
    what: str
    bytes: int
    source: str
    phase: str = THROUGHOUT


@dataclass(frozen=True)
class DeviceMemory:
    """What one device holds; `count` devices hold the same."""

    device: str
    role: str
    lines: tuple[Line, ...]

    @property
    def total(self) -> int:
        """What is held throughout, plus the larger of what only sampling and only training hold
        (with no sampling-only line, training's lines are simply held throughout)."""
        phase = {name: sum(line.bytes for line in self.lines if line.phase == name) for name in (SAMPLING, TRAINING)}
        if not phase[SAMPLING]:
            return sum(line.bytes for line in self.lines)
        return sum(line.bytes for line in self.lines if line.phase == THROUGHOUT) + max(phase.values())


@dataclass(frozen=True)
class MemoryPlan:
    devices: tuple[DeviceMemory, ...]
    capacity: int | None  # bytes of each device, None: not known (no fit check)
    capacity_source: str
    knobs: dict[str, str] = field(default_factory=dict)  # what to turn, with the saving it gives
    notes: tuple[str, ...] = ()  # what the printout says first (the model planned, its stand-ins)

    def problems(self) -> list[str]:
        """A device that the plan does not fit, naming the knobs to turn; none without a capacity."""
        if self.capacity is None:
            return []
        return [
            f"trainer: the memory plan needs {size(device.total)} on {device.device} ({device.role}) but "
            f"it has {size(self.capacity)} ({self.capacity_source}); "
            + "; ".join(f"{knob} ({why})" for knob, why in self.knobs.items())
            + " (python -m recipes.run CONFIG --plan shows the plan)"
            for device in self.devices
            if device.total > self.capacity
        ]

    def render(self) -> str:
        lines = [f"note: {note}" for note in self.notes]
        for device in self.devices:
            lines.append(f"{device.device} ({device.role}):")
            asleep = any(line.phase == SAMPLING for line in device.lines)
            for line in device.lines:
                when = f" (while {line.phase})" if asleep and line.phase else ""
                lines.append(f"  {line.what + when:<36} {size(line.bytes):>10}  {line.source}")
            held = "throughout, and the larger phase" if asleep else ""
            lines.append(f"  {'total':<36} {size(device.total):>10}  {held}".rstrip())
        capacity = "not known: no fit check" if self.capacity is None else size(self.capacity)
        lines.append(f"device memory: {capacity} ({self.capacity_source})")
        for problem in self.problems():
            lines.append(f"DOES NOT FIT: {problem}")
        return "\n".join(lines)


def micro_batch(config) -> tuple[str, int, bool]:
    """(the config's micro-batch key, the rows one micro-batch runs through the denoiser, whether
    they carry classifier-free guidance's unconditional rows): GRPO re-scores `micro_batch_size`
    transitions as they were sampled (guided where the rollouts were); a DPO pair is two rows (the
    winner and the loser); NFT's (sample, noise level) pairs one row each, both without CFG."""
    for name, rows_per_item, guided in (("grpo", 1, True), ("dpo", 2, False), ("nft", 1, False)):
        if config.recipe == name:
            return f"{name}.micro_batch_size", getattr(config, name).micro_batch_size * rows_per_item, guided
    raise ValueError(f"recipe {config.recipe!r} trains nothing: the memory plan is for grpo, dpo and nft configs")


def device_capacity(config) -> tuple[int | None, str]:
    """Bytes of one device of the run: `trainer.device_memory_gib`, else the total of the CUDA device
    `engine.device` names when torch sees it, else not known."""
    gib = config.trainer.device_memory_gib
    if gib is not None:
        return int(gib * GIB), "trainer.device_memory_gib"
    device = torch.device(config.engine.device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"the total of {device} as torch sees it"
    return None, f"{config.engine.device} has no known total; set trainer.device_memory_gib to check the fit"


@dataclass(frozen=True)
class PlannedModel:
    """The meta-device model a plan counts, with the bytes of each component that is not a denoiser
    (name -> bytes) and what the printout says of where they come from."""

    adapter: object
    source: str
    other_bytes: dict[str, int]
    other_sources: dict[str, str]
    notes: tuple[str, ...] = ()
    stand_ins: bool = False  # the text encoders and VAE are a real preset's small stand-ins


def planned_model(config, dtype: torch.dtype) -> PlannedModel:
    """The model of `config` on the meta device: `model.path`'s own configs where it is a folder here
    (or `tiny`), else the published configs of `model.tiny_family`'s real preset built in memory,
    whose stand-in text encoders and VAE count at their published sizes (`Family.published_parts`)."""
    if config.model.path == "tiny" or Path(config.model.path).is_dir():
        folder = config.model.resolve_path()
        adapter = meta_adapter(folder, dtype)
        source = f"{folder}/*/config.json on the meta device, {config.engine.dtype}"
        others = {name: m for name, m in adapter.components.items() if name not in adapter.denoisers}
        return PlannedModel(
            adapter, source, {name: module_bytes(m) for name, m in others.items()}, dict.fromkeys(others, source)
        )
    family = family_named(config.model.tiny_family)
    adapter = preset_adapter(family, dtype)
    source = f"{family.real_model}'s published config.json on the meta device, {config.engine.dtype}"
    element = torch.empty((), dtype=dtype).element_size()
    other_bytes, other_sources, stand_ins = {}, {}, []
    for name, module in adapter.components.items():
        if name in adapter.denoisers:
            continue
        published = family.published_parts.get(name)
        if published is None:  # no published size stated: the stand-in's own, and the printout says so
            other_bytes[name] = module_bytes(module)
            other_sources[name] = f"the preset's stand-in (its published size is not stated), {config.engine.dtype}"
            stand_ins.append(name)
        else:
            other_bytes[name] = published["params"] * element
            other_sources[name] = f"{published['params'] / 1e9:.3g}B parameters: {published['source']}"
    notes = (
        f"model.path {config.model.path!r} is not a folder here: planned with the published configs of "
        f"model.tiny_family {family.name!r} ({family.real_model}), built in memory on the meta device",
        f"its {', '.join(other_bytes)} are the preset's one-layer stand-ins; the weights count "
        + (
            "their published sizes"
            if not stand_ins
            else f"their published sizes where known, the stand-ins' own for {', '.join(stand_ins)} (an undercount)"
        ),
    )
    return PlannedModel(adapter, source, other_bytes, other_sources, notes, stand_ins=True)


@quietly
def preset_adapter(family, dtype: torch.dtype):
    """The family's `PipelineAdapter` over its "real" preset built in memory on the meta device
    (nothing written, no memory taken)."""
    pipeline = family.build_preset("real", InMemory(), device="meta", dtype=dtype).pipeline
    return adapter_class(type(pipeline).__name__)(pipeline)


def activation_peak(config, model: PlannedModel, rows: int, guided: bool) -> int:
    """`train_step_peak` on fake tensors over `model` (its LoRA attached). Where the prompt encoding
    reads values that shape-only tensors lack (a mask that selects tokens: Qwen-Image, Wan, Z-Image,
    HunyuanVideo 1.5) and the text encoders are a real preset's stand-ins (one layer, small), the
    model is built again with real (uninitialised) storage for them, so they encode for real; the
    step itself stays on fake tensors."""
    from trainers_adapters.policy.train_step_peak import train_step_peak

    try:
        return train_step_peak(model.adapter, config.sampling, rows, guided, fake=True)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        if not model.stand_ins:
            raise ValueError(
                f"the memory plan cannot encode a prompt of this model on shape-only tensors ({error!r}); plan "
                "it where model.path is not a folder, from its family's published configs (model.tiny_family)"
            ) from error
    # The failed try gave every module fake storage: start again from a new build.
    adapter = planned_model(config, getattr(torch, config.engine.dtype)).adapter
    prepare_training(adapter, config)
    for name, module in adapter.components.items():
        if name not in adapter.denoisers:
            module.to_empty(device="cpu")
    return train_step_peak(adapter, config.sampling, rows, guided, fake=True, encode_for_real=True)


def prepare_training(adapter, config) -> list[torch.nn.Parameter]:
    """The trainer's LoRA on `adapter`'s denoisers, and gradient checkpointing as the config sets it;
    returns the LoRA parameters."""
    from trainers_adapters.policy.train_step_peak import attach_lora

    lora = attach_lora(adapter, config.lora.peft_config())
    if config.trainer.gradient_checkpointing:
        for denoiser in adapter.denoisers.values():
            denoiser.enable_gradient_checkpointing()
    return lora


def memory_plan(config, ranks: int | None = None) -> MemoryPlan:
    """The plan of training config `config` (a `TrainingConfig`); builds nothing but meta modules
    and reads no weight file. `model.path` is a folder here (a tiny one is built first), or the
    published configs of `model.tiny_family` are planned (`planned_model`). `ranks`: the trainer
    ranks a full policy is sharded over (None: torchrun's WORLD_SIZE, else 1; `full_policy_plan`)."""
    dtype = getattr(torch, config.engine.dtype)
    model = planned_model(config, dtype)
    if config.policy == "full":
        return full_policy_plan(config, model, ranks or int(os.environ.get("WORLD_SIZE", "1")))
    adapter, source = model.adapter, model.source
    denoisers = adapter.denoisers
    denoiser_bytes = sum(module_bytes(module) for module in denoisers.values())
    other_bytes = sum(model.other_bytes.values())
    others = ", ".join(sorted(model.other_bytes)) or "none"
    sleeps = SAMPLING if config.trainer.engine_sleep else THROUGHOUT  # the engine's weights, on the device
    shared = config.trainer.share_base and config.engine.executor == "uni"  # LoraPolicy.sharing_base, colocated
    other_lines = tuple(
        Line(f"engine-only: {name}", model.other_bytes[name], model.other_sources[name], sleeps)
        for name in sorted(model.other_bytes)
    )
    lora = prepare_training(adapter, config)
    lora_bytes = sum(p.numel() * 4 for p in lora)  # float32
    lora_source = f"{sum(p.numel() for p in lora):,} LoRA parameters (rank {config.lora.rank}), float32"
    key, rows, guided = micro_batch(config)
    activations = activation_peak(config, model, rows, guided)
    if guided and adapter.spec.resolve(config.sampling)[0].negative_prompt is not None:
        rows_text = f"{rows} rows + {rows} unconditional (CFG)"
    else:
        rows_text = f"{rows} rows"
    checkpointing = "on" if config.trainer.gradient_checkpointing else "off"
    trainer = (
        Line("LoRA parameters", lora_bytes, lora_source),
        Line("LoRA gradients", lora_bytes, "float32", TRAINING),
        Line("AdamW states", ADAMW_STATES * lora_bytes, "2 float32 states per LoRA parameter"),
        Line(
            "activations of one micro-batch",
            activations,
            f"{key}: {rows_text}, gradient checkpointing {checkpointing}; forward + backward on fake tensors",
            TRAINING,
        ),
    )
    engine_lora = Line("engine's copy of the LoRA", lora_bytes, "the pushed adapter, float32")
    names = ", ".join(denoisers)
    if config.trainer.placement == "colocated":
        if shared:
            weights = (Line("shared weights (engine and trainer)", denoiser_bytes, f"{names}: {source}"),)
        else:  # the trainer loads the whole pipeline again (LoraPolicy(model, ...))
            why = "trainer.share_base false" if not config.trainer.share_base else f"executor {config.engine.executor}"
            weights = (
                Line("engine's denoisers", denoiser_bytes, f"{names}: {source}", sleeps),
                Line("trainer's copy of the pipeline", denoiser_bytes + other_bytes, f"{why}: a second copy"),
            )
        devices = (
            DeviceMemory(
                config.engine.device,
                "each device: an engine and a trainer rank",
                (*weights, *other_lines, engine_lora, *trainer),
            ),
        )
    else:
        devices = (
            DeviceMemory(
                config.engine.device,
                "each engine device",
                (
                    Line("engine's denoisers", denoiser_bytes, f"{names}: {source}"),
                    *other_lines,
                    engine_lora,
                ),
            ),
            DeviceMemory(
                config.engine.device,
                "each trainer device",
                (Line("trainer's copy of the denoisers", denoiser_bytes, f"{names}: {source}"), *trainer),
            ),
        )
    capacity, capacity_source = device_capacity(config)
    per_row = activations / rows
    knobs = {
        f"lower {key}": f"about {size(int(per_row))} of activations a row",
    }
    if not config.trainer.gradient_checkpointing:
        knobs["set trainer.gradient_checkpointing: true"] = "keeps about one block's activations at a time"
    if config.trainer.placement == "colocated":
        if not config.trainer.engine_sleep and not shared:
            freed = size(denoiser_bytes + other_bytes)
            knobs["set trainer.engine_sleep: 1"] = f"the engine's weights ({freed}) leave the device while it trains"
        knobs["set trainer.placement: separate"] = (
            f"the trainer's devices then hold no {others} ({size(other_bytes)}) and no engine"
        )
    knobs["or use GPUs with more memory"] = "a LoRA's data-parallel ranks each hold all of the above"
    return MemoryPlan(devices, capacity, capacity_source, knobs, model.notes)


# A full policy (`policy: full`): what `FullPolicy` holds on each trainer rank beside the engine,
# counted from the meta model as a LoRA's is above. Per trainer rank, with N ranks (FSDP2 over all
# of them): 1/N of the float32 master weights, of their float32 gradients, of AdamW's two float32
# states and, where the update needs the reference (a KL term, DPO), of the frozen float32 reference
# copy; the units FSDP gathers at the engine's dtype while it computes (two: the one running and the
# one prefetched) with one unit's float32 gradient before it is reduce-scattered; the trainer's own
# text encoders and VAE at the engine's dtype (`FullPolicy` loads them: DPO encodes its prompts);
# and one micro-batch's activations, estimated as a LoRA policy's (`activation_peak` on fake
# tensors): every linear layer keeps its input for the backward in both, for a LoRA's weights or a
# full weight's gradient.

FLOAT32 = 4  # bytes: master weights, gradients, AdamW states, the reference


def needs_reference(config) -> bool:
    """Whether the update keeps the reference copy: DPO always, GRPO for its KL term."""
    return config.recipe == "dpo" or (config.recipe == "grpo" and config.grpo.kl_beta > 0)


def largest_unit(denoiser: torch.nn.Module) -> tuple[int, str]:
    """(parameters, what it is) of the largest FSDP unit of `denoiser`: a repeated block, or the
    parameters outside them (the root's unit: embeddings, norms, projections)."""
    classes = repeated_block_classes(denoiser)
    blocks = [m for m in denoiser.modules() if type(m).__name__ in classes]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    rest = sum(p.numel() for p in denoiser.parameters() if id(p) not in in_blocks)
    block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    return (block, f"a {type(blocks[0]).__name__}") if block >= rest else (rest, "the parameters outside the blocks")


def full_policy_plan(config, model: PlannedModel, ranks: int) -> MemoryPlan:
    dtype = getattr(torch, config.engine.dtype)
    element = torch.empty((), dtype=dtype).element_size()
    adapter = model.adapter
    denoisers = adapter.denoisers
    parameters = sum(p.numel() for d in denoisers.values() for p in d.parameters())
    unit, unit_name = max(largest_unit(d) for d in denoisers.values())
    shard = parameters * FLOAT32 // ranks
    over = f"{parameters:,} parameters over {ranks} rank{'s' if ranks > 1 else ''}"
    names = ", ".join(denoisers)
    other_bytes = sum(model.other_bytes.values())
    others = ", ".join(sorted(model.other_bytes)) or "none"
    key, rows, guided = micro_batch(config)
    prepare_training(adapter, config)  # a LoRA: the activations' stand-in (module docstring)
    activations = activation_peak(config, model, rows, guided)
    checkpointing = "on" if config.trainer.gradient_checkpointing else "off"
    trainer = [
        Line("float32 master weights (1/N)", shard, f"{names}: {over}"),
        Line("gradients (1/N)", shard, "float32, reduce-scattered", TRAINING),
        Line("AdamW states (1/N)", ADAMW_STATES * shard, "2 float32 states per parameter"),
    ]
    if needs_reference(config):
        trainer.append(Line("reference weights (1/N)", shard, "float32, for the KL term or DPO"))
    trainer += [
        Line(
            "gathered units",
            unit * (2 * element + FLOAT32),
            f"{unit_name} ({unit:,} parameters) twice at {config.engine.dtype} (running, prefetched) "
            "and its float32 gradient",
            TRAINING,
        ),
        Line(f"trainer's {others}", other_bytes, f"{config.engine.dtype}: the policy's own"),
        Line(
            "activations of one micro-batch",
            activations,
            f"{key}: {rows} rows, gradient checkpointing {checkpointing}; as a LoRA's, on fake tensors",
            TRAINING,
        ),
    ]
    sleeps = SAMPLING if config.trainer.engine_sleep else THROUGHOUT
    engine = [Line("engine's denoisers", parameters * element, f"{names}: {model.source}", sleeps)]
    engine += [
        Line(f"engine's {name}", model.other_bytes[name], model.other_sources[name], sleeps)
        for name in sorted(model.other_bytes)
    ]
    if config.trainer.placement == "colocated":
        both = "each device: an engine and a trainer rank"
        devices = (DeviceMemory(config.engine.device, both, (*engine, *trainer)),)
    else:
        devices = (
            DeviceMemory(config.engine.device, "each engine device", tuple(engine)),
            DeviceMemory(config.engine.device, "each trainer device", tuple(trainer)),
        )
    capacity, capacity_source = device_capacity(config)
    knobs = {
        "more trainer ranks": f"the float32 states shrink as 1/N ({size(shard * (3 + ADAMW_STATES))} at N={ranks})",
        f"lower {key}": f"about {size(int(activations / rows))} of activations a row",
    }
    if not config.trainer.gradient_checkpointing:
        knobs["set trainer.gradient_checkpointing: true"] = "keeps about one block's activations at a time"
    if config.trainer.placement == "colocated":
        if not config.trainer.engine_sleep:
            freed = size(sum(line.bytes for line in engine))
            knobs["set trainer.engine_sleep: 1"] = f"the engine's weights ({freed}) leave the device while it trains"
        knobs["set trainer.placement: separate"] = "the trainer's devices then hold no engine"
    notes = (*model.notes, f"policy full: sharded over {ranks} trainer rank{'s' if ranks > 1 else ''}")
    return MemoryPlan(devices, capacity, capacity_source, knobs, notes)
