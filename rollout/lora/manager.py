"""LoRA adapters on a worker's transformer(s): load (or hot-swap), unload, and pick one per batch.

Adapters are PEFT LoRA layers injected through diffusers' adapter support. An adapter is checked
before it touches the model: every tensor must belong to a module of the model, and every module
its config targets must get its tensors. An adapter that binds nothing is refused, never silently
ignored (a peer project once sampled the base policy for a whole run that way).

A model with several denoisers (Wan 2.2's two experts) has one LoRA target per component. Tensor
keys name theirs with a component prefix (`transformer_2.blocks.0.attn1.to_q.lora_A.weight`); keys
without one (or with `transformer.`) go to the first. An adapter may hold tensors for any of them:
a component it has none for runs its base weights when the adapter is picked.

With `merge` on, a forward runs its adapter merged into the base weights (`rollout.lora.merge`):
`activate` merges, and the base comes back bitwise on the next `activate` of another adapter or
scale, on a load or unload, and on `restore` (which the worker calls before anything reads or
changes the base weights). A model whose LoRA layers are all off for the forward (the base, or a
merged adapter) runs them as their base layers (`rollout.lora.bypass`), at the cost of the model
without adapters; `restore` puts PEFT's forwards back too.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer, _ExcludedModule, check_target_module_exists
from peft.utils import set_peft_model_state_dict
from torch import nn

from rollout.lora.bypass import BypassedLoraLayers
from rollout.lora.merge import MergedLora, merge_problems
from rollout.weights.regular_files import open_regular, read_regular
from rollout.weights.state import DTYPE_RULE, all_finite, converts_exactly

logger = logging.getLogger(__name__)


class LoraLoadFailed(RuntimeError):
    """Building an adapter failed after its checks passed; the worker keeps what it had."""


class LoraShapeRefused(ValueError):
    """A tensor of an adapter has another shape than its config gives the layer it fills."""


# Prefixes that LoRA files put before module names: PEFT's wrapper and diffusers' component name.
_KEY_PREFIXES = ("base_model.model.", "transformer.")
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few KB
FLOAT32 = torch.float32  # the dtype of every LoRA layer, whatever the model's (`adapter_to_float32`)
# Wan 2.2's low-noise expert: a second diffusers LoRA file, keyed like the first.
DIFFUSERS_LORA_FILE_2 = "pytorch_lora_weights_transformer_2.safetensors"
DIFFUSERS_SECOND_COMPONENT = "transformer_2"  # the component whose keys DIFFUSERS_LORA_FILE_2 holds
# Where diffusers' save_lora_weights stores the LoRA config (JSON, keys prefixed by component).
_DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"


def read_lora_folder(
    folder: str | Path, max_bytes: int | None = None
) -> tuple[dict[str, torch.Tensor], LoraConfig | None]:
    """(tensors, config) of a PEFT folder (adapter_config.json + adapter_model.safetensors), or of a
    diffusers LoRA folder (pytorch_lora_weights.safetensors; its config is read from the file's
    metadata where diffusers stored one, else None: inferred from shapes). A folder with
    `DIFFUSERS_LORA_FILE_2` adds its tensors for `transformer_2` (Wan 2.2's low-noise expert).
    Only regular files are read, the weights files of at most `max_bytes` each (None: any size),
    the JSON config of at most 1 MB."""
    folder = Path(folder)
    if (folder / "adapter_config.json").exists():
        config = json.loads(read_regular(folder / "adapter_config.json", "LoRA config", MAX_CONFIG_BYTES))
        return _load_weights(folder / "adapter_model.safetensors", max_bytes), config_from_dict(config)
    path = folder / DIFFUSERS_LORA_FILE
    if path.exists():
        tensors, metadata = _load_weights_and_metadata(path, max_bytes)
        metadata = json.loads(metadata.get(_DIFFUSERS_METADATA_KEY, "{}"))
        prefix = "transformer."
        config = {key.removeprefix(prefix): value for key, value in metadata.items() if key.startswith(prefix)}
        if (folder / DIFFUSERS_LORA_FILE_2).exists():
            second = _load_weights(folder / DIFFUSERS_LORA_FILE_2, max_bytes)
            second = {key.removeprefix(prefix): tensor for key, tensor in second.items()}
            tensors |= {f"{DIFFUSERS_SECOND_COMPONENT}.{key}": tensor for key, tensor in second.items()}
        return tensors, config_from_dict(config) if config else None
    raise ValueError(
        f"LoRA folder {str(folder)!r} holds neither adapter_config.json + adapter_model.safetensors (PEFT) "
        f"nor {DIFFUSERS_LORA_FILE} (diffusers)"
    )


def _load_weights(path: Path, max_bytes: int | None) -> dict[str, torch.Tensor]:
    return _load_weights_and_metadata(path, max_bytes)[0]


def _load_weights_and_metadata(path: Path, max_bytes: int | None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A LoRA weights file's tensors and metadata, read from the descriptor checked to be a regular file."""
    import safetensors.torch

    with open_regular(path, "LoRA weights file", max_bytes) as handle:
        data = handle.read()
    try:
        tensors = safetensors.torch.load(data)
        (length,) = struct.unpack_from("<Q", data)
        metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(f"LoRA weights file {str(path)!r} is not a valid safetensors file: {error}") from None
    return tensors, metadata


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


def count_non_lora_keys(tensors: Mapping[str, torch.Tensor]) -> int:
    """How many keys name no LoRA tensor (`<module>.lora_A.weight`, ...), whatever their prefixes:
    a folder on the server is checked so before anything names its keys (a client that names the
    folder may not be allowed to read it)."""
    keys = normalize_keys({key.removeprefix(f"{DIFFUSERS_SECOND_COMPONENT}."): t for key, t in tensors.items()})
    return sum(_lora_key(key) is None for key in keys)


def infer_config(tensors: Mapping[str, torch.Tensor]) -> LoraConfig:
    """A config for a diffusers LoRA file: its rank from lora_A, alpha = rank, its modules as targets
    (keys as a file or `split_by_component` gives them: the component prefixes do not count)."""
    tensors = normalize_keys({key.removeprefix(f"{DIFFUSERS_SECOND_COMPONENT}."): t for key, t in tensors.items()})
    ranks = {t.shape[0] for key, t in tensors.items() if ".lora_A." in key}
    if len(ranks) != 1:
        raise ValueError(f"cannot infer one LoRA rank from the tensors (found ranks {sorted(ranks)}); pass a config")
    rank = ranks.pop()
    targets = sorted({key.split(".lora_")[0] for key in tensors})
    return LoraConfig(r=rank, lora_alpha=rank, target_modules=targets)


# What a LoRA config from over the network may set: plain LoRA layers on named modules. PEFT reads
# a string `target_modules` (and the keys of rank_pattern / alpha_pattern, layers_pattern) as
# regular expressions matched against every module name: a backtracking one froze a server. The
# other fields build more than LoRA layers (layer_replication, modules_to_save, initialisations
# that decompose the base weights).
_REMOTE_FIELDS = {
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "exclude_modules",
    "init_lora_weights",
    "use_rslora",
    "use_dora",
    "bias",
    "lora_bias",
    "fan_in_fan_out",
    # Bookkeeping that changes nothing built.
    "peft_type",
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
    "peft_version",
}
MAX_REMOTE_RANK = 1024


def remote_config_problems(config: LoraConfig | Mapping | None) -> list[str]:
    """Why a LoRA config sent by a client (a service's upload) is not taken, one line per field;
    [] when it only builds plain LoRA layers on modules it names (None: inferred from the tensors)."""
    if config is None:
        return []
    values = config.to_dict() if isinstance(config, LoraConfig) else dict(config)
    defaults = LoraConfig().to_dict()
    problems = []
    for key in ("target_modules", "exclude_modules"):
        names = values.get(key)
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
            problems.append(
                f"{key} must be a list of module names (a string is a regular expression PEFT matches against every "
                f"module name, refused over the network), got {names!r}"
            )
    rank = values.get("r", defaults["r"])
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_REMOTE_RANK:
        problems.append(f"r must be an integer in [1, {MAX_REMOTE_RANK}], got {rank!r}")
    alpha = values.get("lora_alpha", defaults["lora_alpha"])
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= 1e6:
        problems.append(f"lora_alpha must be a number in (0, 1e6], got {alpha!r}")
    dropout = values.get("lora_dropout", defaults["lora_dropout"])
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        problems.append(f"lora_dropout must be a number in [0, 1), got {dropout!r}")
    if values.get("init_lora_weights", True) not in (True, False, "gaussian"):
        problems.append(f"init_lora_weights must be true, false or 'gaussian', got {values['init_lora_weights']!r}")
    for key, value in values.items():
        if key not in _REMOTE_FIELDS and value not in (defaults.get(key), None, {}, [], ()):
            problems.append(f"{key} is not taken over the network (it is {value!r}); leave it unset")
    return problems


@dataclass
class _Staged:
    """An adapter checked and ready to become the live one of its name."""

    config: LoraConfig
    placed: tuple[str, ...]
    layers: str | None  # the PEFT adapter name of newly built layers; None: a copy into the live ones
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live tensor, new value)


class LoraManager:
    """The adapters of one worker, on `components` (name -> module; the first is the default).

    Loading is two-phase, so that a load that fails anywhere (its checks, PEFT building its layers)
    leaves the worker as it was, and the engine can have every rank take an adapter or none:
    `stage` checks the adapter and builds it beside the live one (new PEFT layers under a name of
    their own; for a hot swap of the same layout, checked copies of the tensors), `commit` makes it
    the live adapter of its name, `rollback` drops what was staged. `load` does the three.

    `merge`: run each forward's adapter merged into the base weights where it merges exactly
    (`lora_merge.merge_problems`); the others run unmerged. `default_targets`: the modules a config
    that names no `target_modules` targets (the family's, as `LoraPolicy` takes them).
    """

    def __init__(
        self,
        components: Mapping[str, nn.Module],
        merge: bool = False,
        sequence_boundaries: Mapping[str, set[str]] | None = None,
        default_targets: Sequence[str] = (),
    ):
        self.components = dict(components)
        self.default_targets = tuple(default_targets)
        self.merge = merge
        # component -> its modules where sequence parallel splits or gathers the tokens, which no
        # adapter may target (`rollout.parallel.sequence.sequence_boundaries`); none on one rank
        self.sequence_boundaries = dict(sequence_boundaries or {})
        self.configs: dict[str, LoraConfig] = {}
        self.placed: dict[str, tuple[str, ...]] = {}  # adapter -> the components it has layers on
        self._layers: dict[str, str] = {}  # adapter -> the PEFT adapter name its live layers carry
        self._staged: dict[str, _Staged] = {}
        self._builds = itertools.count()
        self._active: tuple[str | None, float] | None = None  # what the models are set up for now
        self._merged: dict[str, MergedLora] = {}  # component -> the adapter merged into its weights now
        self._bypassed: dict[str, BypassedLoraLayers] = {}  # component -> its LoRA layers, all off, bypassed
        self._merge_problems: dict[str, list[str]] = {}  # adapter -> why it runs unmerged ([]: it merges)
        # Adapters merged so far: one per change of the forward's adapter or scale, and one more after
        # each `restore` (a merge costs a pass over the targeted weights: 50 ms on SD3.5 Medium).
        self.merges = 0

    def stage(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        config: LoraConfig | Mapping | None,
        check_finite: bool = True,
    ) -> int:
        """Check adapter `name` and build it beside the live one; returns how many modules it
        binds. Refused (ValueError) before anything is built when it does not fit the model, or with
        `check_finite` holds NaN or infinity; a build that fails raises `LoraLoadFailed`. Either
        way the worker is as it was."""
        self.rollback(name)
        if check_finite:
            bad = [key for key, tensor in tensors.items() if not all_finite(tensor)]
            if bad:
                raise ValueError(
                    f"LoRA {name!r} refused: {len(bad)} of its tensors hold NaN or infinite values "
                    f"({sorted(bad)[:5]}); the adapter loaded before under this name (if any) stays. "
                    "A trainer step that diverged usually causes this; pass check_finite=False only to load it anyway"
                )
        rounded = sorted(f"{key} ({t.dtype})" for key, t in tensors.items() if not converts_exactly(t.dtype, FLOAT32))
        if rounded:
            raise ValueError(
                f"LoRA {name!r} refused: the engine holds LoRA layers in float32, and {len(rounded)} of its tensors "
                f"are not exactly float32 values: {rounded[:5]}; {DTYPE_RULE}"
            )
        parts = split_by_component(tensors, list(self.components))
        config = infer_config({k: t for part in parts.values() for k, t in part.items()}) if config is None else config
        config = config_from_dict(config) if isinstance(config, Mapping) else config
        if config.target_modules is None:
            config = self._with_default_targets(name, config)
        if not parts:
            raise ValueError(self._binds_nothing(name, config))
        for component, part in parts.items():
            self._check_fits(name, self.components[component], part, config)
            self._check_clear_of_boundaries(name, component, config)
        same_layout = name in self.configs and _layout(self.configs[name]) == _layout(config)
        if same_layout and self.placed[name] == tuple(parts):
            copies = [pair for c, part in parts.items() for pair in self._copies(name, self.components[c], part)]
            self._staged[name] = _Staged(config, tuple(parts), None, copies)
            return self.bound_modules(name)
        layers = f"{name}-{next(self._builds)}"
        self.restore()  # PEFT builds around the base weights, never around merged ones
        self._active = None  # PEFT activates what it builds
        try:
            self._build(name, layers, parts, config)
        except Exception as error:
            for component in parts:
                _forget_peft_adapter(self.components[component], layers)
            if isinstance(error, LoraShapeRefused):  # refused as a hot swap of the same layout is
                raise
            kept = f"its {name!r} from before" if name in self.configs else f"no adapter named {name!r}"
            raise LoraLoadFailed(
                f"LoRA {name!r} failed to build after its checks passed ({type(error).__name__}: {error}); "
                f"this worker keeps {kept}"
            ) from error
        self._staged[name] = _Staged(config, tuple(parts), layers)
        return sum(_bound_modules(self.components[c], layers) for c in parts)

    def _binds_nothing(self, name: str, config: LoraConfig) -> str:
        """Why an adapter without tensors is refused: it would bind no module, and every request
        that picks it would sample the base policy while its trainer believes it trains one."""
        targets = config.target_modules
        shown = targets if isinstance(targets, str) else sorted(targets)
        modules = (m for model in self.components.values() for m in _base_module_names(model))
        matched = sorted(m for m in modules if _is_target(config, m))
        has = (
            f"the model has {len(matched)} modules it targets (e.g. {matched[:3]}), and they need its "
            "'<module>.lora_A.weight' and '<module>.lora_B.weight' tensors"
            if matched
            else f"the model has no module it targets; LoRA targets of this family: {list(self.default_targets)}"
        )
        return (
            f"LoRA {name!r} refused: it holds no tensors, so it would bind no module (target_modules {shown}); {has}. "
            "An adapter that binds nothing samples the base policy: send the trainer's adapter tensors"
        )

    def _with_default_targets(self, name: str, config: LoraConfig) -> LoraConfig:
        """`config` targeting the family's default modules, as `LoraPolicy` makes a config that
        names none (PEFT itself would look its defaults up by a transformers model type)."""
        if not self.default_targets:
            raise ValueError(f"LoRA {name!r} refused: its config names no target_modules; name the modules it targets")
        return dataclasses.replace(config, target_modules=set(self.default_targets))

    def commit(self, name: str) -> None:
        """Make the adapter staged under `name` the live one (the previous layers are freed)."""
        if name not in self._staged:
            raise ValueError(f"no LoRA {name!r} is staged; stage it first")
        staged = self._staged.pop(name)
        replaced = name in self.configs
        if staged.layers is None:
            with torch.no_grad():
                for target, value in staged.copies:
                    target.copy_(value)
        else:
            if name in self._layers:
                for component in self.placed[name]:
                    _forget_peft_adapter(self.components[component], self._layers[name])
            self._layers[name] = staged.layers
            self.placed[name] = staged.placed
        self.configs[name] = staged.config
        self.restore()  # a merged adapter of this name holds the old values
        self._active = None
        if staged.layers is not None:  # new layers (a copy into the live ones keeps their kinds)
            problems = [p for c in staged.placed for p in merge_problems(self.components[c], staged.layers)]
            self._merge_problems[name] = problems
            if self.merge and problems:
                logger.info("LoRA %r runs unmerged: it has %s", name, "; ".join(problems))
        # A trainer replaces its adapter at every step: said once, then only at DEBUG.
        logger.log(
            logging.DEBUG if replaced else logging.INFO,
            "%s LoRA %r (rank %d) on %d modules",
            "replaced" if replaced else "loaded",
            name,
            staged.config.r,
            self.bound_modules(name),
        )

    def rollback(self, name: str) -> None:
        """Drop what is staged under `name` (nothing staged: nothing to do)."""
        staged = self._staged.pop(name, None)
        if staged is not None and staged.layers is not None:
            for component in staged.placed:
                _forget_peft_adapter(self.components[component], staged.layers)
            self._active = None

    def _build(
        self, name: str, layers: str, parts: Mapping[str, Mapping[str, torch.Tensor]], config: LoraConfig
    ) -> None:
        """PEFT layers named `layers` of `config` holding each component's tensors (adapter `name`'s).
        A tensor whose shape is not its layer's (a rank other than the config's `r`) is refused by
        name (`LoraShapeRefused`), where PEFT's own load would fail with a dump of size mismatches."""
        for component, tensors in parts.items():
            model = self.components[component]
            with warnings.catch_warnings():  # PEFT warns on every second adapter; several is the point here
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                model.add_adapter(config, adapter_name=layers)
            adapter_to_float32(model, layers)
            self._targets(name, model, tensors, layers)
            result = set_peft_model_state_dict(model, tensors, adapter_name=layers)
            if result.unexpected_keys:  # checked before; a PEFT that maps keys differently lands here
                raise RuntimeError(f"PEFT did not place tensors {result.unexpected_keys[:3]}")

    def _copies(self, name: str, model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> list[tuple]:
        """A hot swap with the same layout copies into the live adapter's tensors (40x faster than
        PEFT rebuilding its layers): (target, value) for each, every shape checked, values on the
        targets' device and dtype."""
        pairs = self._targets(name, model, tensors, self._layers[name])
        return [(target, tensor.to(target.device, target.dtype)) for target, tensor in pairs]

    def _targets(self, name: str, model: nn.Module, tensors: Mapping[str, torch.Tensor], layers: str) -> list[tuple]:
        """(parameter of the LoRA layers named `layers`, tensor) for each of adapter `name`'s
        tensors; `LoraShapeRefused` naming the first whose shape is not its parameter's."""
        pairs = []
        for key, tensor in tensors.items():
            module_name, kind, leaf = _lora_key(key)
            target = getattr(model.get_submodule(f"{module_name}.lora_{kind}.{layers}"), leaf)
            if target.shape != tensor.shape:
                raise LoraShapeRefused(
                    f"LoRA {name!r} refused: {key} expected {list(target.shape)}, got {list(tensor.shape)}"
                )
            pairs.append((target, tensor))
        return pairs

    def unload(self, name: str) -> None:
        if name not in self.configs:
            raise ValueError(f"no LoRA named {name!r} is loaded; loaded: {sorted(self.configs)}")
        self.rollback(name)
        layers = self._layers.pop(name)
        self.restore()
        for component in self.placed.pop(name):
            _forget_peft_adapter(self.components[component], layers)
        del self.configs[name]
        del self._merge_problems[name]
        self._active = None

    def activate(self, name: str | None, scale: float) -> None:
        """Set the models up to run adapter `name` at `scale` (the base weights where it has no
        layers), or the base models for None. With `merge` on, an adapter that merges exactly is
        merged into the base weights, its LoRA layers off; any adapter merged before is restored.
        A component whose LoRA layers end up all off runs them as their base layers (`lora_bypass`)."""
        if self._active == (name, scale):
            return
        self.restore()
        self._active = None  # until the models are set up: a failure below leaves nothing believed
        merge = self.merge and name is not None and not self._merge_problems[name]
        if merge:
            merge = self._merge(name, scale)
        # Staged layers count: PEFT activates what it builds, and they must not run before their commit.
        with_layers = {c for placed in self.placed.values() for c in placed}
        with_layers |= {c for staged in self._staged.values() for c in staged.placed}
        for component, model in self.components.items():
            if name is not None and component in self.placed[name]:
                if merge:
                    model.disable_lora()  # the merged weights hold the delta its layers would add
                else:
                    model.enable_lora()
                    model.set_adapters([self._layers[name]], [scale])
                    continue
            elif component in with_layers:
                model.disable_lora()
            else:
                continue  # no LoRA layers to bypass
            self._bypassed[component] = BypassedLoraLayers(model)
        self._active = (name, scale)

    def _merge(self, name: str, scale: float) -> bool:
        """Merge adapter `name` at `scale` into the base weights of every component it has layers
        on; False (nothing merged) where the device has no memory for the merged copy."""
        try:
            for component in self.placed[name]:
                self._merged[component] = MergedLora(self.components[component], self._layers[name], scale)
        except torch.OutOfMemoryError:
            self.restore()
            logger.warning(
                "LoRA %r runs unmerged: merging it ran out of memory (it needs one more copy of the weights it "
                "targets); set merge_lora='never' to stop trying",
                name,
            )
            return False
        self.merges += 1
        return True

    def set_merge(self, merge: bool) -> None:
        """Turn merging on or off from the next `activate` on (the base weights are restored now)."""
        self.restore()
        self.merge = merge
        self._active = None

    @property
    def merged(self) -> tuple[str, float] | None:
        """(adapter, scale) merged into the base weights now, or None."""
        return self._active if self._merged else None

    def restore(self) -> None:
        """Put the base weights back (bitwise) where an adapter is merged into them, and PEFT's
        forwards where LoRA layers are bypassed; the next `activate` merges and bypasses again.
        Anything that reads or changes the base weights or the LoRA layers calls this first."""
        if not (self._merged or self._bypassed):
            return
        for bypassed in self._bypassed.values():
            bypassed.put_back()
        self._bypassed.clear()
        for merged in self._merged.values():
            merged.restore()
        self._merged.clear()
        self._active = None

    def staged_is_live(self, name: str) -> bool:
        """Whether the adapter staged under `name` is its live one exactly: the same config and
        layout, and every tensor equal (a re-push of what is loaded, which changes nothing)."""
        staged = self._staged.get(name)
        if staged is None or staged.layers is not None or staged.config != self.configs[name]:
            return False
        with torch.no_grad():
            return all(torch.equal(target, value) for target, value in staged.copies)

    def bound_modules(self, name: str) -> int:
        """How many modules adapter `name` binds."""
        return sum(_bound_modules(self.components[c], self._layers[name]) for c in self.placed[name])

    def peft_name(self, name: str) -> str:
        """The name the live layers of adapter `name` carry inside the model (`policy-0`): PEFT
        names their tensors by it (`...to_q.lora_A.policy-0.weight`). A load that builds new
        layers (a new layout) gives them a new one; a hot swap of the same layout keeps it."""
        if name not in self._layers:
            raise ValueError(f"no LoRA named {name!r} is loaded; loaded: {sorted(self.configs)}")
        return self._layers[name]

    def _check_fits(
        self, name: str, model: nn.Module, tensors: Mapping[str, torch.Tensor], config: LoraConfig
    ) -> None:
        """Refuse, before anything changes, an adapter that does not fit the model exactly."""
        malformed = [key for key in tensors if _lora_key(key) is None]
        if malformed:
            raise ValueError(
                f"LoRA {name!r} refused: {len(malformed)} keys are not LoRA tensor names "
                f"({sorted(malformed)[:3]}); expected '<module>.lora_A.weight' and '<module>.lora_B.weight'"
            )
        modules = _base_module_names(model)
        given = {key.split(".lora_")[0] for key in tensors}
        if not given & modules:
            raise ValueError(
                f"LoRA {name!r} refused: its keys match no module of the model "
                f"(e.g. {sorted(tensors)[:3]}); expected keys like 'block_sizes.0.attn.to_q.lora_A.weight'"
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

    def _check_clear_of_boundaries(self, name: str, component: str, config: LoraConfig) -> None:
        """Refuse an adapter on a module where sequence parallel splits or gathers the tokens. Merged
        into the base weights it would sample right, but a merge can fall back to the unmerged
        path forward by forward (`lora_merge.merge_problems`), so the refusal does not depend on it."""
        crossing = sorted(m for m in self.sequence_boundaries.get(component, ()) if _is_target(config, m))
        if crossing:
            raise ValueError(
                f"LoRA {name!r} refused: it targets {component} modules {crossing}, where sequence parallel splits "
                "or gathers the token sequence (diffusers' context-parallel plan), so the adapter's path would see "
                "another part of the sequence than its base layer; leave them out of target_modules (or list them "
                "in exclude_modules), or run this adapter with sequence_parallel=1"
            )


def _lora_key(key: str) -> tuple[str, str, str] | None:
    """(module, kind, leaf) of a LoRA tensor name: `<module>.lora_A.weight` (A or B, weight or bias),
    or DoRA's `<module>.lora_magnitude_vector.weight`; None for anything else."""
    module_name, separator, rest = key.partition(".lora_")
    kind, _, leaf = rest.partition(".")
    if not (separator and module_name):
        return None
    if (kind in ("A", "B") and leaf in ("weight", "bias")) or (kind == "magnitude_vector" and leaf == "weight"):
        return module_name, kind, leaf
    return None


def _forget_peft_adapter(model: nn.Module, layers: str) -> None:
    """Remove every trace of PEFT adapter `layers` from `model`, whatever stage it reached: its
    layers, its config entry, and diffusers' flag that a config is loaded (which a failed first
    add_adapter leaves set with no config, and every later add_adapter then fails on)."""
    with warnings.catch_warnings():  # PEFT warns when a deleted adapter was the active one
        warnings.simplefilter("ignore")
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.delete_adapter(layers)
    configs = getattr(model, "peft_config", None)
    if configs is not None:
        configs.pop(layers, None)
        if not configs:
            del model.peft_config
    if getattr(model, "peft_config", None) is None:
        model._hf_peft_config_loaded = False


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
