"""Reading a config's YAML with every key once: PyYAML keeps the last of two equal keys silently,
so a config with two `trainer:` sections would run without the first one's settings."""

from __future__ import annotations

from pathlib import Path

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a mapping holding the same key twice."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} appears twice in one mapping (YAML would keep only the last)",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read_yaml(path: str | Path):
    """The YAML document in the file at `path`, as `yaml.safe_load` reads it; a key twice in a
    mapping is a `yaml.YAMLError` that names it, the file and the line."""
    with open(path) as file:
        return yaml.load(file, _UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
