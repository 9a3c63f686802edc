"""Strict YAML topologies (``configs/topologies/*.yaml``), written with the generators.

A topology file names a ``generator`` and its parameters; ``hierarchical`` nests two more
(``domain`` and ``fabric``). Links are mappings with a bandwidth per direction, either
``bandwidth_GBps`` (10^9 B/s) or ``bandwidth_Gbps`` (10^9 bit/s), and ``latency_us``::

    description: 16 DGX H100 nodes on a 2:1 tapered leaf/spine
    generator: hierarchical
    domains: 16
    domain: {generator: switch_domain, gpus: 8, link: {bandwidth_GBps: 450, latency_us: 1.5}}
    fabric:
      generator: fat_tree
      levels: 2
      radix: 48
      oversubscription: 2
      hosts: 128
      link: {bandwidth_Gbps: 400, latency_us: 2.5}

Unknown keys, missing keys and bad values are errors naming the file, the dotted field, the
value and what is valid; a generator's own objection (a radix that cannot be tapered 2:1) is
reported the same way. ``generator: cluster`` builds the graph of a cluster preset
(``from_cluster``).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from diffcost import config
from diffcost.network import generators as gen
from diffcost.network.graph import NODE_KINDS, LinkSpec, Topology
from diffcost.spec_values import ConfigError, invalid


def _did_you_mean(word: str, valid) -> str:
    close = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else "; valid: " + ", ".join(valid)


def _int(value, where, path):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(where, path, value, "a positive integer")
    return value


def _float(value, where, path):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise invalid(where, path, value, "a number > 0")
    return float(value)


def _bool(value, where, path):
    if not isinstance(value, bool):
        raise invalid(where, path, value, "true or false")
    return value


def _ints(value, where, path):
    if not isinstance(value, list) or not value:
        raise invalid(where, path, value, "a non-empty list of positive integers")
    return [_int(v, where, f"{path}[{i}]") for i, v in enumerate(value)]


def _link(value, where, path, extra=()) -> LinkSpec:
    if not isinstance(value, Mapping):
        raise invalid(
            where, path, value, "a mapping {bandwidth_GBps or bandwidth_Gbps, latency_us}"
        )
    allowed = ("bandwidth_GBps", "bandwidth_Gbps", "latency_us", *extra)
    for key in value:
        if key not in allowed:
            raise ConfigError(f"unknown key '{path}.{key}' in {where}{_did_you_mean(key, allowed)}")
    given = [k for k in ("bandwidth_GBps", "bandwidth_Gbps") if k in value]
    if len(given) != 1:
        raise ConfigError(
            f"{where}: {path} needs exactly one of bandwidth_GBps (10^9 B/s) or bandwidth_Gbps "
            f"(10^9 bit/s) per direction, got {given or 'neither'}"
        )
    bandwidth = _float(value[given[0]], where, f"{path}.{given[0]}")
    latency = value.get("latency_us", 0.0)
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0:
        raise invalid(where, f"{path}.latency_us", latency, "a number >= 0")
    Bps = bandwidth * 1e9 if given[0] == "bandwidth_GBps" else bandwidth * 1e9 / 8.0
    return LinkSpec(Bps, float(latency) * 1e-6)


def _kinds(value, where, path):
    if not isinstance(value, list) or not value:
        raise invalid(
            where, path, value, f"a non-empty list of node kinds ({', '.join(NODE_KINDS)})"
        )
    for i, kind in enumerate(value):
        if kind not in NODE_KINDS:
            raise invalid(where, f"{path}[{i}]", kind, f"one of {', '.join(NODE_KINDS)}")
    return list(value)


def _cables(value, where, path):
    if not isinstance(value, list) or not value:
        raise invalid(where, path, value, "a non-empty list of {a, b, bandwidth_..., count}")
    cables = []
    for i, item in enumerate(value):
        here = f"{path}[{i}]"
        link = _link(item, where, here, extra=("a", "b", "count"))
        for end in ("a", "b"):
            if end not in item:
                raise ConfigError(f"{where}: {here} is missing '{end}' (a node index)")
            if isinstance(item[end], bool) or not isinstance(item[end], int) or item[end] < 0:
                raise invalid(where, f"{here}.{end}", item[end], "a node index >= 0")
        count = _int(item.get("count", 1), where, f"{here}.count")
        cables.append((item["a"], item["b"], link, count))
    return cables


def _node_ids(value, where, path):
    if not isinstance(value, list) or not value:
        raise invalid(where, path, value, "a non-empty list of node indices")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise invalid(where, f"{path}[{i}]", v, "a node index >= 0")
    return list(value)


def _cluster(value, where, path):
    if not isinstance(value, str):
        raise invalid(where, path, value, "a cluster preset name or file")
    try:
        return config.load_cluster(value)
    except ConfigError as err:
        raise ConfigError(f"{where}: {path}: {err}") from None


# Per generator: its function and its keys, each ``(checker, required)``; a checker is
# ``(value, where, path) -> argument``.
Checker = Callable[[Any, str, str], Any]
_LINK = (_link, True)
GENERATORS: dict[str, tuple[Callable[..., Topology], dict[str, tuple[Checker, bool]]]] = {
    "switch_domain": (
        gen.switch_domain,
        {
            "gpus": (_int, True),
            "link": _LINK,
            "switches": (_int, False),
            "switch_reduction": (_bool, False),
        },
    ),
    "mesh": (gen.mesh, {"gpus": (_int, True), "link": _LINK}),
    "cube_mesh": (gen.cube_mesh, {"link": _LINK}),
    "torus": (gen.torus, {"dims": (_ints, True), "link": _LINK}),
    "exponential": (gen.exponential, {"n": (_int, True), "link": _LINK}),
    "tree": (gen.tree, {"fanout": (_int, True), "depth": (_int, True), "link": _LINK}),
    "fat_tree": (
        gen.fat_tree,
        {
            "levels": (_int, True),
            "radix": (_int, True),
            "link": _LINK,
            "oversubscription": (_float, False),
            "hosts": (_int, False),
        },
    ),
    "leaf_spine": (
        gen.leaf_spine,
        {
            "leaves": (_int, True),
            "hosts_per_leaf": (_int, True),
            "link": _LINK,
            "oversubscription": (_float, False),
            "spines": (_int, False),
        },
    ),
    "rail_optimized": (
        gen.rail_optimized,
        {
            "rails": (_int, True),
            "units": (_int, True),
            "hosts_per_unit": (_int, True),
            "link": _LINK,
            "spines_per_rail": (_int, False),
            "cores": (_int, False),
            "oversubscription": (_float, False),
        },
    ),
    "hierarchical": (
        gen.hierarchical,
        {
            "domain": (lambda v, w, p: _topology(v, w, p), True),
            "domains": (_int, True),
            "fabric": (lambda v, w, p: _topology(v, w, p), True),
            "nic_link": (_link, False),
        },
    ),
    "explicit": (
        lambda nodes, links, endpoints=None: gen.explicit(nodes, links, endpoints),
        {"nodes": (_kinds, True), "links": (_cables, True), "endpoints": (_node_ids, False)},
    ),
    "cluster": (gen.from_cluster, {"cluster": (_cluster, True), "nodes": (_int, True)}),
}
_DOC_KEYS = ("description", "name")


def _topology(tree: Any, where: str, prefix: str) -> Topology:
    """Build the topology a (possibly nested) mapping describes."""
    path = prefix or "the top level"
    if not isinstance(tree, Mapping):
        raise invalid(where, path, tree, "a mapping with a 'generator' key")
    dot = f"{prefix}." if prefix else ""
    name = tree.get("generator")
    if name not in GENERATORS:
        valid = ", ".join(GENERATORS)
        if name is None:
            raise ConfigError(f"{where}: {dot}generator is missing; valid generators: {valid}")
        raise invalid(where, f"{dot}generator", name, f"one of {valid}")
    make, schema = GENERATORS[name]
    allowed = ("generator", *_DOC_KEYS, *schema)
    for key in tree:
        if key not in allowed:
            hint = _did_you_mean(str(key), allowed)
            raise ConfigError(f"unknown key '{dot}{key}' in {where} ({name}){hint}")
    missing = [k for k, (_, required) in schema.items() if required and k not in tree]
    if missing:
        keys = ", ".join(f"'{dot}{k}'" for k in missing)
        raise ConfigError(f"{where}: generator {name} is missing {keys}")
    kwargs = {
        k: check(tree[k], where, f"{dot}{k}") for k, (check, _) in schema.items() if k in tree
    }
    try:
        topology = make(**kwargs)
    except ValueError as err:
        raise ConfigError(f"{where}: {path} ({name}): {err}") from None
    return topology


def topologies_dir() -> Path:
    """The folder of topology presets: ``topologies/`` next to the other preset folders."""
    return config.configs_dir() / "topologies"


def available_topologies() -> list[str]:
    """Names of the topology presets, sorted."""
    folder = topologies_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def load_topology(name_or_path: str | os.PathLike) -> Topology:
    """Load a topology preset (``"dgx-h100-superpod"``) or YAML file.

    Returns:
        The :class:`Topology`, named after the file unless it sets ``name``.

    Raises:
        ConfigError: an unknown preset or file, or anything the schema rejects.
    """
    text = os.fspath(name_or_path)
    if "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ConfigError(f"topology file not found: {path}")
    else:
        path = topologies_dir() / f"{text}.yaml"
        if not path.is_file():
            presets = available_topologies()
            raise ConfigError(f"unknown topology preset {text!r}{_did_you_mean(text, presets)}")
    tree, where = config.read_yaml(path)
    topology = _topology(tree, where, "")
    name = tree.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise invalid(where, "name", name, "a non-empty string")
    return gen.renamed(topology, name)
