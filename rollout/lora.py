"""LoRA adapters on a worker's transformer(s): load (or hot-swap), unload, and pick one per batch.

Adapters are PEFT LoRA layers injected through diffusers' adapter support. An adapter is checked
before it touches the model: every tensor must belong to a module of the model, and every module
its config targets must get its tensors. An adapter that binds nothing is refused, never silently
ignored (a peer project once sampled the base policy for a whole run that way).

A model with several denoisers (Wan 2.2's two experts) has one LoRA target per component. Tensor
keys name theirs with a component prefix (`transformer_2.blocks.0.attn1.to_q.lora_A.weight`); keys
without one (or with `transformer.`) go to the first. An adapter may hold tensors for any of them:
a component it has none for runs its base weights when the adapter is picked.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import _ExcludedModule, check_target_module_exists
from peft.utils import set_peft_model_state_dict
from torch import nn

from rollout.weights import all_finite

logger = logging.getLogger(__name__)


class LoraLoadFailed(RuntimeError):
    """Loading an adapter failed after its checks passed; the worker holds no adapter of its name."""


# Prefixes that LoRA files put before module names: PEFT's wrapper and diffusers' component name.
_KEY_PREFIXES = ("base_model.model.", "transformer.")
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"
# Wan 2.2's low-noise expert: a second diffusers LoRA file, keyed like the first.
DIFFUSERS_LORA_FILE_2 = "pytorch_lora_weights_transformer_2.safetensors"
# Where diffusers' save_lora_weights stores the LoRA config (JSON, keys prefixed by component).
_DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"


def read_lora_folder(folder: str | Path) -> tuple[dict[str, torch.Tensor], LoraConfig | None]:
    """(tensors, config) of a PEFT folder (adapter_config.json + adapter_model.safetensors), or of a
    diffusers LoRA folder (pytorch_lora_weights.safetensors; its config is read from the file's
    metadata where diffusers stored one, else None: inferred from shapes). A folder with
    `DIFFUSERS_LORA_FILE_2` adds its tensors for `transformer_2` (Wan 2.2's low-noise expert)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    folder = Path(folder)
    if (folder / "adapter_config.json").is_file():
        config = json.loads((folder / "adapter_config.json").read_text())
        return load_file(folder / "adapter_model.safetensors"), config_from_dict(config)
    path = folder / DIFFUSERS_LORA_FILE
    if path.is_file():
        with safe_open(path, framework="pt") as file:
            metadata = json.loads((file.metadata() or {}).get(_DIFFUSERS_METADATA_KEY, "{}"))
        prefix = "transformer."
        config = {key.removeprefix(prefix): value for key, value in metadata.items() if key.startswith(prefix)}
        tensors = load_file(path)
        if (folder / DIFFUSERS_LORA_FILE_2).is_file():
            second = load_file(folder / DIFFUSERS_LORA_FILE_2)
            tensors |= {"transformer_2." + key.removeprefix(prefix): tensor for key, tensor in second.items()}
        return tensors, config_from_dict(config) if config else None
    raise ValueError(
        f"LoRA folder {str(folder)!r} holds neither adapter_config.json + adapter_model.safetensors (PEFT) "
        f"nor {DIFFUSERS_LORA_FILE} (diffusers)"
    )


def config_from_dict(config: Mapping) -> LoraConfig:
    known = set(LoraConfig.__dataclass_fields__)
    return LoraConfig(**{key: value for key, value in config.items() if key in known})


def normalize_keys(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module-relative PEFT keys without the adapter name: `blocks.0.attn.to_q.lora_A.weight`."""
    normalized = {}
    for key, tensor in tensors.items():
        for prefix in _KEY_PREFIXES:
            key = key.removeprefix(prefix)
        normalized[key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = tensor
    return normalized


def split_by_component(tensors: Mapping[str, torch.Tensor], components: Sequence[str]) -> dict[str, dict]:
    """The tensors of each component that has any, keyed as `normalize_keys` keys them. A key names
    its component with a prefix (`transformer_2.`); without one it is the first component's."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        key = key.removeprefix("base_model.model.")
        component = next((name for name in components[1:] if key.startswith(name + ".")), components[0])
        parts.setdefault(component, {})[key.removeprefix(component + ".")] = tensor
    return {component: normalize_keys(part) for component, part in parts.items()}


def infer_config(tensors: Mapping[str, torch.Tensor]) -> LoraConfig:
    """A config for a diffusers LoRA file: its rank from lora_A, alpha = rank, its modules as targets."""
    ranks = {t.shape[0] for key, t in tensors.items() if ".lora_A." in key}
    if len(ranks) != 1:
        raise ValueError(f"cannot infer one LoRA rank from the tensors (found ranks {sorted(ranks)}); pass a config")
    rank = ranks.pop()
    targets = sorted({key.split(".lora_")[0] for key in tensors})
    return LoraConfig(r=rank, lora_alpha=rank, target_modules=targets)


class LoraManager:
    """The adapters of one worker, on `components` (name -> module; the first is the default)."""

    def __init__(self, components: Mapping[str, nn.Module]):
        self.components = dict(components)
        self.configs: dict[str, LoraConfig] = {}
        self.placed: dict[str, tuple[str, ...]] = {}  # adapter -> the components it has layers on
        self._active: tuple[str | None, float] | None = None  # what the models are set up for now

    def load(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        config: LoraConfig | Mapping | None,
        check_finite: bool = True,
    ) -> int:
        """Load adapter `name` (replacing one of that name); returns how many modules it binds.
        `check_finite` refuses an adapter holding NaN or infinity (ValueError), the old one staying."""
        if check_finite:
            bad = [key for key, tensor in tensors.items() if not all_finite(tensor)]
            if bad:
                raise ValueError(
                    f"LoRA {name!r} refused: {len(bad)} of its tensors hold NaN or infinite values "
                    f"({sorted(bad)[:5]}); the adapter loaded before under this name (if any) stays. "
                    "A trainer step that diverged usually causes this; pass check_finite=False only to load it anyway"
                )
        parts = split_by_component(tensors, list(self.components))
        config = infer_config({k: t for part in parts.values() for k, t in part.items()}) if config is None else config
        config = config_from_dict(config) if isinstance(config, Mapping) else config
        for component, part in parts.items():
            self._check_fits(name, self.components[component], part, config)
        same_layout = name in self.configs and _layout(self.configs[name]) == _layout(config)
        if same_layout and self.placed[name] == tuple(parts):
            return sum(self._copy_in_place(name, self.components[c], part) for c, part in parts.items())
        try:
            self._rebuild(name, parts, config)
        except Exception as error:
            # Past the checks the old adapter may be gone: say so with a type that is not a refusal
            # (ValueError), so the engine does not take it for "nothing changed".
            if name in self.configs:
                self.unload(name)
            raise LoraLoadFailed(
                f"LoRA {name!r} failed to load after its checks passed ({type(error).__name__}: {error}); "
                "this worker holds no adapter of that name now"
            ) from error
        bound = self.bound_modules(name)
        logger.info("loaded LoRA %r (rank %d) on %d modules", name, config.r, bound)
        return bound

    def _rebuild(self, name: str, parts: Mapping[str, Mapping[str, torch.Tensor]], config: LoraConfig) -> None:
        """Replace adapter `name` with PEFT layers of `config` holding each component's tensors."""
        if name in self.configs:
            self.unload(name)
        self.configs[name] = config
        self.placed[name] = ()
        self._active = None
        for component, tensors in parts.items():
            model = self.components[component]
            with warnings.catch_warnings():  # PEFT warns on every second adapter; several is the point here
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                model.add_adapter(config, adapter_name=name)
            self.placed[name] += (component,)
            adapter_to_float32(model, name)
            result = set_peft_model_state_dict(model, tensors, adapter_name=name)
            if result.unexpected_keys:  # checked before; a PEFT that maps keys differently lands here
                raise RuntimeError(f"PEFT did not place tensors {result.unexpected_keys[:3]}")

    def _copy_in_place(self, name: str, model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
        """Hot swap with the same layout: copy into the adapter's tensors (40x faster than PEFT
        rebuilding its layers). Every shape is checked before the first copy."""
        targets = {}
        for key, tensor in tensors.items():
            module_name, _, rest = key.partition(".lora_")
            kind, _, leaf = rest.partition(".")  # "A" / "B", "weight"
            target = getattr(model.get_submodule(f"{module_name}.lora_{kind}.{name}"), leaf)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"LoRA {name!r} refused: {key} expected {list(target.shape)}, got {list(tensor.shape)}"
                )
            targets[key] = target
        with torch.no_grad():
            for key, target in targets.items():
                target.copy_(tensors[key])
        return _bound_modules(model, name)

    def unload(self, name: str) -> None:
        if name not in self.configs:
            raise ValueError(f"no LoRA named {name!r} is loaded; loaded: {sorted(self.configs)}")
        for component in self.placed.pop(name):
            self.components[component].delete_adapters(name)
        del self.configs[name]
        self._active = None

    def activate(self, name: str | None, scale: float) -> None:
        """Set the models up to run adapter `name` at `scale` (the base weights where it has no
        layers), or the base models for None."""
        if self._active == (name, scale) or (name is None and not self.configs):
            return
        for component, model in self.components.items():
            if name is not None and component in self.placed[name]:
                model.enable_lora()
                model.set_adapters([name], [scale])
            elif any(component in placed for placed in self.placed.values()):
                model.disable_lora()
        self._active = (name, scale)

    def bound_modules(self, name: str) -> int:
        return sum(_bound_modules(self.components[component], name) for component in self.placed[name])

    def _check_fits(
        self, name: str, model: nn.Module, tensors: Mapping[str, torch.Tensor], config: LoraConfig
    ) -> None:
        """Refuse, before anything changes, an adapter that does not fit the model exactly."""
        modules = _base_module_names(model)
        given = {key.split(".lora_")[0] for key in tensors}
        if not given & modules:
            raise ValueError(
                f"LoRA {name!r} refused: its keys match no module of the model "
                f"(e.g. {sorted(tensors)[:3]}); expected keys like 'transformer_blocks.0.attn.to_q.lora_A.weight'"
            )
        targeted = {m for m in modules if _is_target(config, m)}
        problems = []
        if given - modules:
            problems.append(
                f"{len(given - modules)} of its modules are not in the model: {sorted(given - modules)[:5]}"
            )
        if targeted - given:
            problems.append(
                f"its config targets {len(targeted - given)} modules it has no tensors for: "
                f"{sorted(targeted - given)[:5]}"
            )
        if (given & modules) - targeted:
            problems.append(
                f"it has tensors for {len((given & modules) - targeted)} modules its config does not "
                f"target: {sorted((given & modules) - targeted)[:5]}"
            )
        if problems:
            raise ValueError(f"LoRA {name!r} refused: " + "; ".join(problems))


def _bound_modules(model: nn.Module, name: str) -> int:
    return sum(1 for module in model.modules() if isinstance(module, LoraLayer) and name in module.lora_A)


def adapter_to_float32(model: nn.Module, name: str) -> None:
    """Keep LoRA `name`'s weights in float32 whatever the model's dtype (PEFT makes them in the
    model's). The trainer's copy holds them in float32 to train them, and the engine must compute the
    same numbers: with bfloat16 adapters on one side the ratio drifts to ~2e-4 after the first update."""
    for module in model.modules():
        if isinstance(module, LoraLayer) and name in module.lora_A:
            module.lora_A[name].float()
            module.lora_B[name].float()


def _base_module_names(model: nn.Module) -> set[str]:
    """Names of the model's own modules, whether or not PEFT has wrapped them."""
    names = set()
    for module_name, _ in model.named_modules():
        if ".lora_" in module_name or module_name.endswith(".base_layer") or ".base_layer." in module_name:
            continue
        names.add(module_name)
    return names


def _is_target(config: LoraConfig, module_name: str) -> bool:
    match = check_target_module_exists(config, module_name)
    return bool(match) and not isinstance(match, _ExcludedModule)


def _layout(config: LoraConfig) -> tuple:
    """What decides the shapes and placement of an adapter's tensors (not their values)."""
    targets = config.target_modules
    targets = targets if isinstance(targets, str) else tuple(sorted(targets or ()))
    return (
        config.r,
        config.lora_alpha,
        targets,
        config.use_rslora,
        config.use_dora,
        tuple(sorted((config.rank_pattern or {}).items())),
        tuple(sorted((config.alpha_pattern or {}).items())),
        str(config.exclude_modules),
    )
