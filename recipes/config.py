"""Recipe configs: a YAML file plus `--set key=value` overrides, checked into one dataclass per recipe.

A recipe's config is a dataclass (subclass of `RecipeConfig`) whose fields are plain values or
sections; a section is itself a dataclass, so later recipes (GRPO, DPO) add their own sections
next to the shared `model`, `engine` and `sampling` ones. Every field is a `rollout.settings.setting`
carrying its one-line help, the engine's dataclasses (`SamplingParams`, `GRPOSettings`, ...) as much
as the recipes' own sections, and `python -m recipes.run --help` lists them with their defaults, so
the documentation of the keys cannot drift from the code. The `engine` section takes its fields'
defaults and help from `EngineConfig`'s.

Values are matched to each field's declared type; a float field also takes an int, or a number
written as text: YAML 1.1 (PyYAML) reads `1e-5` without a dot as a string.

Checking collects every problem (unknown keys, wrong types, missing keys, bad values caught by a
dataclass's `__post_init__`) and raises them together in one ValueError. A dataclass's own value
checks run once its fields are well-typed and its sections are valid, since they may compare fields.

Checking imports no torch, diffusers or fastapi, so a typo is answered at once: the keys, values,
model families and model folder are checked with plain data. What can only be checked by importing
what the config names (the executor and worker extension classes, the reward classes, devices) is
a config's `import_problems`, which `load_config` runs once everything else is valid; the engine,
the tiny builders and the service client are imported when a recipe runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
import shutil
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rollout.config import EngineConfig, settings_problems
from rollout.pipelines.families import families_of, family_named, family_names, request_field_problems
from rollout.pipelines.model_index import read_model_index
from rollout.serve import API_KEY_ENV
from rollout.settings import setting, setting_help, setting_of

if TYPE_CHECKING:
    from rollout.engine.rollout_engine import RolloutEngine
    from rollout.serve.client import RemoteRolloutEngine

logger = logging.getLogger(__name__)

# The recipes a config may name (`recipe:`); `recipes.loading.RECIPES` maps each to its module.
RECIPE_NAMES = ("rollout", "grpo", "dpo", "nft")

TINY_MODEL = "tiny"


option = setting  # the recipes' name for a config field with its help (shown by `--help`)


@dataclass(kw_only=True)
class ModelSection:
    path: str = option(
        TINY_MODEL, f"local diffusers pipeline folder, or {TINY_MODEL!r} for a tiny random pipeline of tiny_family"
    )
    tiny_family: str = option(
        "sd3",
        f"family of the tiny pipeline (path {TINY_MODEL!r}), and the family whose published configs --plan builds "
        f"where path is not a folder here: {', '.join(family_names())}",
    )
    tiny_cache_dir: str | None = option(
        None, f"where path={TINY_MODEL!r} builds its pipeline once and reuses it; null: .cache/tiny_<tiny_family>"
    )

    def __post_init__(self) -> None:
        if self.tiny_family not in family_names():
            raise ValueError(f"tiny_family must be one of {sorted(family_names())}, got {self.tiny_family!r}")

    def resolve_path(self) -> str:
        """The pipeline folder to load; for `tiny`, builds it into `tiny_cache_dir` the first time, and
        again when the tiny builders have changed since (`rollout.pipelines.tiny.saving.is_current_build`)."""
        if self.path != TINY_MODEL:
            return self.path
        from rollout.pipelines.tiny.saving import is_current_build  # the builders: torch and diffusers

        cache = Path(self.tiny_cache_dir or f".cache/tiny_{self.tiny_family}")
        stale = (cache / "model_index.json").is_file()
        if stale and is_current_build(cache):
            logger.info("using the tiny %s pipeline cached in %s", self.tiny_family, cache)
            return str(cache)
        if stale:  # a pipeline that other builders made (or older ones, before they stamped their folders)
            logger.warning(
                "the tiny %s pipeline cached in %s was built by other tiny builders than these; rebuilding it",
                self.tiny_family,
                cache,
            )
        elif cache.exists() and any(cache.iterdir()):
            raise ValueError(
                f"model.tiny_cache_dir {str(cache)!r} is not empty but holds no model_index.json; "
                "empty it or point model.tiny_cache_dir at a new folder"
            )
        family = self.tiny_family
        logger.info("building a tiny %s pipeline (random weights) into %s; later runs reuse it", family, cache)
        cache.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the cache and rename, so an interrupted build never leaves a half-written cache.
        staging = cache.with_name(f".{cache.name}.building-{os.getpid()}")
        if staging.exists():
            shutil.rmtree(staging)  # left by an interrupted build of an earlier process with this pid
        family_named(self.tiny_family).build_tiny(staging, seed=0)
        if stale:
            shutil.rmtree(cache)
        elif cache.exists():
            cache.rmdir()  # empty, checked above
        os.rename(staging, cache)
        return str(cache)


@dataclass(kw_only=True)
class EngineSection:
    """The `EngineConfig` knobs a recipe sets; `model` comes from the model section. With `url`, the
    recipe uses a running rollout service instead, and the server's own settings apply."""

    url: str | None = option(
        None,
        "http://host:port of a rollout service (python -m rollout.serve) to use instead of an engine in this "
        f"process; its API key comes from ${API_KEY_ENV}; null: run the engine here",
    )
    # YAML can name an executor or extension class only by its dotted path, hence `str` here.
    executor: str = setting_of(EngineConfig, "executor")
    worker_extension_cls: str | None = setting_of(EngineConfig, "worker_extension_cls")
    num_workers: int = setting_of(EngineConfig, "num_workers")
    threads_per_worker: int | None = setting_of(EngineConfig, "threads_per_worker")
    sequence_parallel: int = setting_of(EngineConfig, "sequence_parallel")
    cfg_parallel: int = setting_of(EngineConfig, "cfg_parallel")
    device: str = setting_of(EngineConfig, "device")
    dtype: str = setting_of(EngineConfig, "dtype")
    max_batch_size: int = setting_of(EngineConfig, "max_batch_size")
    merge_lora: str = setting_of(EngineConfig, "merge_lora")
    attention_backend: str | None = setting_of(EngineConfig, "attention_backend")
    compile: str = setting_of(EngineConfig, "compile")  # a training recipe's policy compiles the same way

    def __post_init__(self) -> None:
        problems = settings_problems(**self._engine_settings())
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            problems.append(f"url must start with http:// or https://, got {self.url!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def class_problems(self) -> list[str]:
        """What the executor and worker extension classes (imported, and torch with them), the
        executor's own rules and the attention backend (what the installed diffusers and torch run
        on `device`) find wrong with these settings."""
        from rollout.engine.config_check import problems_without_model

        return problems_without_model(**self._engine_settings())

    def to_engine_config(self, model_path: str) -> EngineConfig:
        return EngineConfig(model=model_path, **self._engine_settings())

    def open_engine(self, model_path: str) -> RolloutEngine | RemoteRolloutEngine:
        """The engine a recipe drives: a client of the service at `url`, or an engine in this process."""
        from rollout.engine.rollout_engine import RolloutEngine
        from rollout.serve.client import RemoteRolloutEngine

        if self.url is None:
            return RolloutEngine(self.to_engine_config(model_path))
        logger.info("using the rollout service at %s (its own engine settings apply)", self.url)
        return RemoteRolloutEngine(self.url)  # its key: $ROLLOUT_API_KEY

    def service_problems(self) -> list[str]:
        """With `url`: connect once, so that a service that is not there, or that refuses this client
        (no key, a wrong one), says so as a config problem before the recipe writes or loads anything."""
        from rollout.errors import EngineDeadError
        from rollout.serve.client import RemoteRolloutEngine

        if self.url is None:
            return []
        try:
            RemoteRolloutEngine(self.url).shutdown()
        except (EngineDeadError, TimeoutError) as error:
            why = error.__cause__ or error  # the transport's own error, not "lost" a server never reached
            return [
                f"engine.url: no rollout service answers at {self.url} ({type(why).__name__}: {why}); start one "
                "(python -m rollout.serve), or set engine.url to null to run the engine in this process"
            ]
        except PermissionError as error:
            return [f"engine.url: {error}"]
        return []

    def _engine_settings(self) -> dict:
        settings = dataclasses.asdict(self)
        del settings["url"]
        return settings


@dataclass(kw_only=True)
class RecipeConfig:
    """Base of every recipe's config; `recipe` picks the recipe (one of `RECIPE_NAMES`).

    A recipe states its checks of values and combinations in `value_problems`, over a dict of the
    keys that are well-formed, so they run (and report) even when other keys of the same file are
    broken: one error then lists every problem. They import no torch; checks that must import
    what they check go in `import_problems`.
    """

    recipe: str = option(help=f"which recipe to run: {', '.join(RECIPE_NAMES)}")

    def __post_init__(self) -> None:
        problems = self.value_problems({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def value_problems(cls, values: dict[str, Any]) -> list[str]:
        """Problems of the values in `values` (key -> checked value); a key that is missing was
        malformed and has been reported already, so checks that need it are skipped."""
        return []

    def import_problems(self) -> list[str]:
        """Problems found by importing what the config names (classes, rewards; torch with them),
        each prefixed with its key: run by `load_config` once every key and value is valid, so that
        a config with a typo is answered without those imports."""
        return []

    def fit_problems(self) -> list[str]:
        """Whether what the recipe holds in memory fits the devices it names (a training config's
        memory plan); run by `load_config` after `import_problems`. None by default."""
        return []


def model_problems(model: ModelSection, sampling: Any, folder_must_exist: bool) -> list[str]:
    """What the model would refuse, known before it loads: a `model.path` that is not a supported
    pipeline folder (only if `folder_must_exist`: a config may be checked where its model is not),
    and the fields of `sampling` (a `SamplingParams`; None: not known) that its family does not take."""
    if model.path == TINY_MODEL:
        families = (family_named(model.tiny_family),)
    else:
        try:
            families = families_of(read_model_index(model.path)["_class_name"])
        except ValueError as error:
            return [f"model.path: {error}"] if folder_must_exist else []
    if sampling is None:
        return []
    return [f"sampling: {problem}" for problem in request_field_problems(families, sampling)]


def model_problems_of(values: dict[str, Any], folder_must_exist: bool) -> list[str]:
    """`model_problems` of a recipe config's well-formed values (a malformed section was reported)."""
    if values.get("model") is None:
        return []
    return model_problems(values["model"], values.get("sampling"), folder_must_exist)


def check_setup(config: RecipeConfig) -> None:
    """Raise ValueError with `model_problems` (the folder must exist) and the service's at
    `engine.url` (`EngineSection.service_problems`): a recipe's first act, before it writes or loads
    anything."""
    problems = model_problems(config.model, config.sampling, folder_must_exist=True)
    problems = problems or config.engine.service_problems()
    if problems:
        raise ValueError("invalid config: " + "; ".join(problems))


def apply_overrides(data: dict, overrides: Sequence[str]) -> list[str]:
    """Set each "a.b.c=value" in `data` (value parsed as YAML, so "4" is an int); returns the
    problems with overrides that could not be applied."""
    problems = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        if not sep or not key:
            problems.append(f"--set {text!r}: expected KEY=VALUE, e.g. sampling.num_inference_steps=4")
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            problems.append(f"--set {text!r}: the value is not valid YAML ({error})")
            continue
        *parents, leaf = key.split(".")
        node = data
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                prefix = ".".join(parents[: depth + 1])
                problems.append(f"--set {text!r}: {prefix!r} is a value, not a section")
                break
        else:
            node[leaf] = value
    return problems


def build_section(
    cls: type, data: Any, prefix: str, problems: list[str], checks: Callable[[dict], list[str]] | None = None
) -> Any:
    """Check `data` against dataclass `cls` and build it; appends problems instead of raising.
    `checks`: more checks of a recipe config's well-formed values (its sections built), beside
    its own `value_problems`.

    Returns the instance, or None when something was wrong.
    """
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        problems.append(f"{where}: expected a section (a mapping of keys), got {data!r}")
        return None
    count = len(problems)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            problems.append(_unknown_key(prefix, str(key), list(fields)))
    kwargs = {}
    malformed = set()
    for name, f in fields.items():
        key = f"{prefix}{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"{key}: missing; {setting_help(cls, name)}")
                malformed.add(name)
            continue
        before = len(problems)
        kwargs[name] = _convert(data[name], hints[name], key, problems)
        if len(problems) > before:
            malformed.add(name)
    if issubclass(cls, RecipeConfig):  # its value checks run on the well-formed keys, even if others are not
        values = {name: _default(f) for name, f in fields.items() if name not in data and name not in malformed}
        values |= {name: value for name, value in kwargs.items() if name not in malformed}
        problems += [f"{where}: {problem}" for problem in cls.value_problems(values)]
        problems += checks(values) if checks is not None else []
    if len(problems) > count:
        return None
    try:
        return cls(**kwargs)
    except ValueError as error:  # the dataclass's own checks of values and combinations
        problems.append(f"{where}: {error}")
        return None


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _convert(value: Any, annotation: Any, key: str, problems: list[str]) -> Any:
    if dataclasses.is_dataclass(annotation):
        return build_section(annotation, value, f"{key}.", problems)
    converted = _match(value, annotation)
    if converted is _NO_MATCH:
        problems.append(f"{key}: expected {_type_name(annotation)}, got {value!r} ({type(value).__name__})")
    return converted


_NO_MATCH = object()
# A decimal number written as text, as a float field takes it: YAML 1.1 reads 1e-5 (no dot) as a string.
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _match(value: Any, annotation: Any) -> Any:
    """`value` converted to `annotation` (YAML list -> tuple, int -> float), or _NO_MATCH."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            converted = _match(value, arm)
            if converted is not _NO_MATCH:
                return converted
        return _NO_MATCH
    if annotation is type(None):
        return None if value is None else _NO_MATCH
    if annotation is bool:
        return value if isinstance(value, bool) else _NO_MATCH
    if annotation is int:  # YAML true/false are bools, which Python counts as ints
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_MATCH
    if annotation is float:
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else _NO_MATCH
    if annotation is str:
        return value if isinstance(value, str) else _NO_MATCH
    if origin is list and isinstance(value, list):
        items = [_match(item, args[0]) for item in value]
        return _NO_MATCH if _NO_MATCH in items else items
    if origin is tuple and args[-1] is Ellipsis and isinstance(value, list | tuple):  # tuple[int, ...]
        items = tuple(_match(item, args[0]) for item in value)
        return _NO_MATCH if _NO_MATCH in items else items
    if origin is tuple and isinstance(value, list | tuple) and len(value) == len(args):
        items = tuple(_match(item, arm) for item, arm in zip(value, args, strict=True))
        return _NO_MATCH if _NO_MATCH in items else items
    if origin in (list, tuple):
        return _NO_MATCH
    if annotation is dict:  # a mapping whose keys the field's own checks read (the reward's settings)
        return dict(value) if isinstance(value, dict) else _NO_MATCH
    if origin is dict and isinstance(value, dict):  # dict[str, X]
        items = {_match(key, args[0]): _match(item, args[1]) for key, item in value.items()}
        return _NO_MATCH if _NO_MATCH in items or _NO_MATCH in items.values() else items
    if origin is dict:
        return _NO_MATCH
    raise TypeError(
        f"config fields of type {annotation!r} are not supported; use str, int, float, bool, list, tuple, dict"
    )


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arm) for arm in args)
    if annotation is type(None):
        return "null"
    if origin is list:
        return f"a list of {_type_name(args[0])}"
    if origin is tuple and args[-1] is Ellipsis:
        return f"a list of {_type_name(args[0])}"
    if origin is tuple:
        return f"a list [{', '.join(_type_name(arm) for arm in args)}]"
    if annotation is dict:
        return "a mapping"
    if origin is dict:
        return f"a mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    return annotation.__name__


def _unknown_key(prefix: str, key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {prefix + close[0]!r}?" if close else f"valid keys here: {', '.join(known)}"
    return f"unknown key {prefix + key!r}; {hint}"


def format_problems(path: str | Path, problems: list[str]) -> str:
    noun = "problem" if len(problems) == 1 else "problems"
    return f"invalid config {path} ({len(problems)} {noun}):\n" + "\n".join(f"  - {p}" for p in problems)


# Describing.


def config_keys(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(dotted key, default as YAML/JSON text, one-line help) of every leaf key of config `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            yield from config_keys(hints[f.name], f"{prefix}{f.name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = json.dumps(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = json.dumps(f.default_factory())
        else:
            default = "(required)"
        yield f"{prefix}{f.name}", default, setting_help(cls, f.name)


def to_dict(config: RecipeConfig) -> dict:
    """The config as plain JSON-able data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))
