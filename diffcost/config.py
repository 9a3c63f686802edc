"""Strict YAML loading of models, clusters, plans and experiments.

Every file is checked against the fields of the dataclasses in :mod:`diffcost.specs`: an unknown
key is an error with a "did you mean" suggestion, a value of the wrong type or outside its range
names the file, the dotted field path, the value and what would be valid. Files may extend one
another with ``base:``; an experiment may be adjusted with ``key=value`` overrides.

Preset names (no ``/`` and no ``.yaml``) are looked up in ``{models,clusters,plans,examples}/
NAME.yaml`` of the presets shipped with the package (``diffcost/configs``), or under the
directory named by the environment variable ``DIFFCOST_CONFIGS``; a bare file name such as
``gpt3-175b.yaml`` that is not in the working directory is looked up there too. Names starting
with ``_`` are bases: they can be named in ``base:`` but are not listed as presets.

Loading has no side effects: nothing is printed and no state is kept apart from a cache of parsed
files keyed by path and modification time.

Examples:
    >>> exp = load_experiment("gpt3-175b", ["plan.dp=16", "gpus=2048"])
    >>> exp.plan.n_gpus, exp.model.name
    (2048, 'gpt3-175b')
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from diffcost import constraints
from diffcost.constraints import divisors as _divisors
from diffcost.constraints import join as _join
from diffcost.specs import (
    PLACED_DIMS,
    PRECISIONS,
    ZERO_STAGES,
    ClusterSpec,
    Experiment,
    GpuSpec,
    ModelSpec,
    MoeSpec,
    PlanSpec,
)
from diffcost.topology import INTRA_NODE

__all__ = [
    "ConfigError",
    "available_presets",
    "check_plan",
    "configs_dir",
    "load_cluster",
    "load_experiment",
    "load_model",
    "load_plan",
    "parse_overrides",
    "validate_experiment",
]

CONFIGS_ENV = "DIFFCOST_CONFIGS"
# The presets, examples and calibrated profiles shipped inside the package.
PACKAGE_CONFIGS = Path(__file__).resolve().parent / "configs"
KINDS = ("models", "clusters", "plans", "examples")
_KIND_NOUN = {"models": "model", "clusters": "cluster", "plans": "plan", "examples": "experiment"}
_SECTIONS = {"model": "models", "cluster": "clusters", "plan": "plans"}
# Keys that document a file and are accepted even where the dataclass has no such field.
_DOC_KEYS = ("description",)
# Floating-point fields that may be zero; every other number must be positive.
_NON_NEGATIVE = frozenset({"nvlink_latency_us", "nic_latency_us"})


class ConfigError(ValueError):
    """A configuration file, preset name or override is invalid.

    The message names the file (when there is one), the dotted field path, the bad value and
    what would be valid.
    """


# --------------------------------------------------------------------------------------------
# Schemas: which keys each kind of file may hold.  A value of ``None`` is a leaf; a mapping is a
# nested section whose keys are checked in turn.
# --------------------------------------------------------------------------------------------


def _leaf_keys(cls: type, *extra: str) -> dict[str, Any]:
    return {**{f.name: None for f in dataclasses.fields(cls)}, **{k: None for k in extra}}


_MOE_SCHEMA = _leaf_keys(MoeSpec)
_GPU_SCHEMA = {**_leaf_keys(GpuSpec), "peak_tflops": {p: None for p in PRECISIONS}}
_SCHEMAS: dict[str, dict[str, Any]] = {
    "models": {**_leaf_keys(ModelSpec, "base", *_DOC_KEYS), "moe": _MOE_SCHEMA},
    "clusters": {**_leaf_keys(ClusterSpec, "base", *_DOC_KEYS), "gpu": _GPU_SCHEMA},
    "plans": _leaf_keys(PlanSpec, "base", *_DOC_KEYS),
}
_SCHEMAS["examples"] = {
    "base": None,
    "description": None,
    "gpus": None,
    **{section: _SCHEMAS[kind] for section, kind in _SECTIONS.items()},
}


# --------------------------------------------------------------------------------------------
# Locating and reading files.
# --------------------------------------------------------------------------------------------


def configs_dir() -> Path:
    """The directory holding the preset folders.

    Returns:
        ``$DIFFCOST_CONFIGS`` when set, else the presets shipped with the package
        (``PACKAGE_CONFIGS``).
    """
    override = os.environ.get(CONFIGS_ENV)
    if override:
        return Path(override).expanduser().resolve()
    return PACKAGE_CONFIGS


def available_presets(kind: str) -> list[str]:
    """Names of the presets of one kind, sorted; bases (names starting with ``_``) excluded.

    Args:
        kind: one of ``"models"``, ``"clusters"``, ``"plans"``, ``"examples"``.

    Returns:
        Preset names, i.e. file names without ``.yaml``.

    Raises:
        ConfigError: if ``kind`` is not one of the above.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown preset kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    folder = configs_dir() / kind
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_"))


def _is_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.endswith((".yaml", ".yml"))


def _display(path: Path) -> str:
    """Short name of a file for messages: relative to the configs folder or to the cwd."""
    for root in (configs_dir(), Path.cwd()):
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            continue
    return str(path)


def _suggest(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` or ``"; valid: a, b, c"`` for an unknown ``word``.

    Args:
        word: the unknown name.
        candidates: the valid names.
        prefix: dotted path put in front of every suggested name.
    """
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        close = [lowered[word.lower()]]
    else:
        close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    return "; valid: " + (", ".join(prefix + c for c in candidates) if candidates else "(none)")


def _locate(kind: str, name_or_path: str | os.PathLike, relative_to: Path | None = None) -> Path:
    """Turn a preset name or a path into an existing file.

    Args:
        kind: preset folder to look in for bare names.
        name_or_path: a preset name (no ``/``, no ``.yaml``) or a file path.
        relative_to: directory that relative paths start from (default: the cwd).

    Returns:
        The resolved path of the file.

    Raises:
        ConfigError: if the preset or file does not exist.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(
            f"{_KIND_NOUN[kind]} must be a preset name or a file path, got {name_or_path!r}"
        )
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or _is_path(text):
        path = Path(text).expanduser()
        if not path.is_absolute():
            path = (relative_to or Path.cwd()) / path
        shipped = configs_dir() / kind / text
        if not path.is_file() and Path(text).name == text and shipped.is_file():
            return shipped.resolve()  # a bare file name of a shipped preset: "gpt3-175b.yaml"
        if not path.is_file():
            raise ConfigError(f"{_KIND_NOUN[kind]} file not found: {path}")
        return path.resolve()
    path = configs_dir() / kind / f"{text}.yaml"
    if not path.is_file():
        presets = available_presets(kind)
        bases = sorted(p.stem for p in path.parent.glob("_*.yaml"))
        suggestion = _suggest(text, bases if text.startswith("_") else presets)
        raise ConfigError(
            f"unknown {_KIND_NOUN[kind]} preset {text!r}"
            + (suggestion if "did you mean" in suggestion else "")
            + f" Available presets in {path.parent}: {', '.join(presets) or '(none)'}"
            + (f"; bases: {', '.join(bases)}" if text.startswith("_") else "")
        )
    return path.resolve()


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys in a mapping."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


@functools.lru_cache(maxsize=256)
def _parse_file(path: str, mtime_ns: int, size: int) -> Any:
    del mtime_ns, size  # part of the cache key only
    with open(path, encoding="utf-8") as stream:
        return yaml.load(stream, Loader=_StrictLoader)  # a SafeLoader subclass


def _read_yaml(path: Path) -> dict[str, Any]:
    """Parse a YAML file whose top level must be a mapping with string keys.

    Returns:
        A fresh copy of the parsed mapping (the cache is never handed out).

    Raises:
        ConfigError: on a YAML syntax error, duplicate key or non-mapping document.
    """
    stat = path.stat()
    try:
        data = _parse_file(str(path), stat.st_mtime_ns, stat.st_size)
    except yaml.YAMLError as err:
        raise ConfigError(f"{_display(path)}: invalid YAML: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{_display(path)}: the top level must be a mapping of keys to values, "
            f"got {type(data).__name__}"
        )
    return copy.deepcopy(data)


# --------------------------------------------------------------------------------------------
# Trees: keys checks, base inheritance, merging.
# --------------------------------------------------------------------------------------------


def _check_keys(tree: Mapping, schema: Mapping[str, Any], where: str, prefix: str = "") -> None:
    """Raise on the first key of ``tree`` that ``schema`` does not allow (recursively).

    Raises:
        ConfigError: "unknown key 'hiden' in models/foo.yaml; did you mean 'hidden'?".
    """
    for key, value in tree.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {prefix}{key!r} must be a string")
        if key not in schema:
            suggestion = _suggest(key, list(schema), prefix)
            raise ConfigError(f"unknown key '{prefix}{key}' in {where}{suggestion}")
        sub_schema = schema[key]
        if isinstance(sub_schema, Mapping) and isinstance(value, Mapping):
            _check_keys(value, sub_schema, where, f"{prefix}{key}.")


def _deep_merge(base: Mapping, top: Mapping) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _anchor_base(value: Any, directory: Path) -> Any:
    """Make a relative-path ``base`` absolute, so that it survives merging into other files."""
    if isinstance(value, str) and _is_path(value):
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else (directory / path).resolve())
    return value


def _normalize_sections(tree: dict[str, Any], directory: Path) -> dict[str, Any]:
    """In an experiment tree, write each ``model``/``cluster``/``plan`` as a mapping."""
    for section in _SECTIONS:
        value = tree.get(section)
        if isinstance(value, str):
            tree[section] = {"base": _anchor_base(value, directory)}
        elif isinstance(value, dict) and "base" in value:
            value["base"] = _anchor_base(value["base"], directory)
    return tree


def _load_tree(kind: str, path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a file, check its keys and resolve its ``base`` chain.

    Args:
        kind: the folder kind, which fixes the schema and where base names are looked up.
        path: resolved path of the file.
        chain: files already being loaded further down the chain (for cycle detection).

    Returns:
        The merged mapping, without ``base``.

    Raises:
        ConfigError: on unknown keys, a missing base or a cycle of bases.
    """
    if path in chain:
        cycle = " -> ".join(_display(p) for p in (*chain, path))
        raise ConfigError(f"cycle of 'base:' references: {cycle}")
    tree = _read_yaml(path)
    where = _display(path)
    _check_keys(tree, _SCHEMAS[kind], where)
    if kind == "examples":
        _normalize_sections(tree, path.parent)
    if not chain and kind in ("models", "clusters") and "name" not in tree:
        tree["name"] = path.stem  # the file loaded names the spec, not its bases
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ConfigError(f"{where}: base={base!r} must be a preset name or a file path")
    try:
        base_path = _locate(kind, base, relative_to=path.parent)
    except ConfigError as err:
        raise ConfigError(f"{where}: base: {err}") from None
    return _deep_merge(_load_tree(kind, base_path, (*chain, path)), tree)


def _resolve_base(kind: str, tree: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Resolve a ``base`` key inside an inline mapping (e.g. an experiment's ``model:``)."""
    tree = dict(tree)
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ConfigError(f"{where}: base={base!r} must be a preset name or a file path")
    try:
        base_path = _locate(kind, base)
    except ConfigError as err:
        raise ConfigError(f"{where}: base: {err}") from None
    return _deep_merge(_load_tree(kind, base_path), tree)


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings with dotted keys into a nested mapping.

    Values are read with ``yaml.safe_load``: ``4`` is an int, ``full`` a string,
    ``[dp,tp,cp,pp]`` a list, ``null`` is None.

    Args:
        overrides: strings such as ``"plan.tp=4"`` or ``"cluster.gpu.memory_GiB=40"``.

    Returns:
        Nested dict, e.g. ``{"plan": {"tp": 4}}``.

    Raises:
        ConfigError: on a string without ``=``, an empty key part, a value YAML cannot read, or
            two overrides that conflict (``plan=fsdp`` and ``plan.tp=2``).

    Examples:
        >>> parse_overrides(["plan.tp=4", "plan.order=[dp,tp,cp,pp]"])
        {'plan': {'tp': 4, 'order': ['dp', 'tp', 'cp', 'pp']}}
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    result: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = str(item).partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(
                f"override {item!r} must look like key=value with a dotted key, e.g. plan.tp=4"
            )
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {err}") from None
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r} conflicts with an earlier override that set "
                    f"{'.'.join(parts[: depth + 1])}={child!r}"
                )
            node = child
        if isinstance(node.get(parts[-1]), dict) and not isinstance(value, dict):
            raise ConfigError(
                f"override {item!r} conflicts with earlier overrides of {key.strip()}.*"
            )
        node[parts[-1]] = value
    return result


# --------------------------------------------------------------------------------------------
# Values: type and range checks, building the dataclasses.
# --------------------------------------------------------------------------------------------


def _invalid(where: str, path: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{where}: {path}={value!r} is invalid: expected {expected}")


def _check_int(value: Any, where: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(where, path, value, f"a positive integer (got {type(value).__name__})")
    if value < 1:
        raise _invalid(where, path, value, "a positive integer")
    return value


def _check_float(value: Any, where: str, path: str, allow_zero: bool = False) -> float:
    bound = "a number >= 0" if allow_zero else "a number > 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str) and _looks_numeric(value):
            hint = f"; YAML reads {value} as text, write it with a '.' before the 'e', e.g. 1.0e+3"
        raise _invalid(where, path, value, f"{bound} (got {type(value).__name__}{hint})")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise _invalid(where, path, value, bound)
    return float(value)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_bool(value: Any, where: str, path: str) -> bool:
    if not isinstance(value, bool):
        raise _invalid(where, path, value, "true or false")
    return value


def _check_str(value: Any, where: str, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise _invalid(where, path, value, "a non-empty string")
    return value


def _check_choice(value: Any, choices: Sequence[Any], where: str, path: str) -> Any:
    if isinstance(value, bool) or value not in choices:
        raise _invalid(where, path, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def _check_scalar(name: str, hint: Any, value: Any, where: str, path: str) -> Any:
    """Check one leaf value against its dataclass type annotation."""
    arms = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    if type(None) in arms:  # ``X | None``: null is allowed, anything else is checked as X
        if value is None:
            return None
        (hint,) = [arm for arm in arms if arm is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return _check_choice(value, typing.get_args(hint), where, path)
    if hint is bool:
        return _check_bool(value, where, path)
    if hint is int:
        return _check_int(value, where, path)
    if hint is float:
        return _check_float(value, where, path, allow_zero=name in _NON_NEGATIVE)
    if hint is str:
        return value if name == "description" and value == "" else _check_str(value, where, path)
    raise TypeError(f"no checker for field {name!r} of type {hint!r}")  # a bug, not user input


def _build(
    cls: type,
    tree: Mapping[str, Any],
    where: str,
    prefix: str,
    special: Mapping[str, Callable[[Any, str], Any]] | None = None,
) -> Any:
    """Check the keys present in ``tree`` against ``cls``'s fields and construct it.

    Args:
        cls: a dataclass of :mod:`diffcost.specs`.
        tree: merged mapping; keys not among the fields must be ``_DOC_KEYS``.
        where: file name (or ``"overrides"``) for messages.
        prefix: dotted path of ``tree`` inside the file, e.g. ``"model."``.
        special: converters for fields whose type is not a plain scalar, called with the value
            and its dotted path.

    Returns:
        An instance of ``cls``.

    Raises:
        ConfigError: on a missing required key or a bad value.
    """
    special = special or {}
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    missing = [
        f.name
        for f in fields
        if f.name not in tree
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        names = ", ".join(f"'{prefix}{m}'" for m in missing)
        raise ConfigError(f"{where}: missing required key{'s' if len(missing) > 1 else ''} {names}")
    kwargs = {}
    for f in fields:
        if f.name not in tree:
            continue
        path = f"{prefix}{f.name}"
        if f.name in special:
            kwargs[f.name] = special[f.name](tree[f.name], path)
        else:
            kwargs[f.name] = _check_scalar(f.name, hints[f.name], tree[f.name], where, path)
    return cls(**kwargs)


def _build_moe(value: Any, where: str, path: str) -> MoeSpec | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _invalid(where, path, value, "a mapping {experts: N, top_k: K} or null")
    moe = _build(MoeSpec, value, where, path + ".")
    if moe.top_k > moe.experts:
        raise ConfigError(
            f"{where}: {path}.top_k={moe.top_k} is invalid: expected at most "
            f"{path}.experts={moe.experts}"
        )
    return moe


def _model_from_tree(tree: Mapping[str, Any], where: str, prefix: str = "") -> ModelSpec:
    """Build and check a :class:`ModelSpec` from a merged mapping."""

    def moe(value: Any, path: str) -> MoeSpec | None:
        return _build_moe(value, where, path)

    model = _build(ModelSpec, tree, where, prefix, {"moe": moe})
    if model.heads % model.kv_heads:
        raise ConfigError(
            f"{where}: {prefix}heads={model.heads} is not divisible by "
            f"{prefix}kv_heads={model.kv_heads}; kv_heads must divide heads "
            f"(valid kv_heads: {_join(_divisors(model.heads))})"
        )
    if model.hidden % model.heads:
        raise ConfigError(
            f"{where}: {prefix}hidden={model.hidden} is not divisible by "
            f"{prefix}heads={model.heads} (head size would be {model.hidden / model.heads:g}); "
            f"valid heads: {_join(_divisors(model.hidden))}"
        )
    return model


def _peak_tflops(value: Any, where: str, path: str) -> dict[str, float]:
    if not isinstance(value, Mapping) or not value:
        raise _invalid(
            where,
            path,
            value,
            f"a mapping from precision ({_join(PRECISIONS)}) to dense TFLOP/s, e.g. {{bf16: 312}}",
        )
    peaks = {}
    for precision, tflops in value.items():
        _check_choice(precision, PRECISIONS, where, f"{path} key")
        peaks[precision] = _check_float(tflops, where, f"{path}.{precision}")
    return peaks


def _cluster_from_tree(tree: Mapping[str, Any], where: str, prefix: str = "") -> ClusterSpec:
    """Build and check a :class:`ClusterSpec` (with its nested ``gpu:``) from a mapping."""

    def gpu(value: Any, path: str) -> GpuSpec:
        if not isinstance(value, Mapping):
            raise _invalid(where, path, value, "a mapping with " + _join(_GPU_SCHEMA))

        def peaks(v: Any, p: str) -> dict[str, float]:
            return _peak_tflops(v, where, p)

        return _build(GpuSpec, value, where, path + ".", {"peak_tflops": peaks})

    cluster = _build(ClusterSpec, tree, where, prefix, {"gpu": gpu})
    topology = INTRA_NODE.get(
        _check_choice(cluster.intra_node, tuple(INTRA_NODE), where, f"{prefix}intra_node")
    )
    if why := topology.node_error_fn(cluster.gpus_per_node):
        raise ConfigError(
            f"{where}: {prefix}gpus_per_node={cluster.gpus_per_node} does not fit "
            f"{prefix}intra_node={cluster.intra_node!r}: {why}"
        )
    return cluster


def _plan_from_tree(tree: Mapping[str, Any], where: str, prefix: str = "") -> PlanSpec:
    """Build and check a :class:`PlanSpec` from a merged mapping."""

    def zero(value: Any, path: str) -> int:
        return _check_choice(value, ZERO_STAGES, where, path)

    def order(value: Any, path: str) -> tuple[str, ...]:
        expected = f"a permutation of [{', '.join(PLACED_DIMS)}] (innermost first)"
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise _invalid(where, path, value, expected)
        if sorted(value) != sorted(PLACED_DIMS):
            raise _invalid(where, path, list(value), expected)
        return tuple(value)

    plan = _build(PlanSpec, tree, where, prefix, {"zero": zero, "order": order})
    if plan.schedule == "interleaved" and plan.chunks < 2:
        raise ConfigError(
            f"{where}: {prefix}chunks={plan.chunks} is invalid with "
            f"{prefix}schedule='interleaved': expected chunks >= 2 (virtual stages per rank); "
            "use schedule: 1f1b for one chunk"
        )
    if plan.schedule != "interleaved" and plan.chunks > 1:
        raise ConfigError(
            f"{where}: {prefix}chunks={plan.chunks} needs an interleaved pipeline, but "
            f"{prefix}schedule={plan.schedule!r}; use schedule: interleaved or chunks: 1"
        )
    return plan


_BUILDERS = {"models": _model_from_tree, "clusters": _cluster_from_tree, "plans": _plan_from_tree}


def _with_name(tree: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    if kind in ("models", "clusters") and "name" not in tree:
        tree["name"] = name
    return tree


def _load_one(kind: str, name_or_path: str | os.PathLike, overrides: Mapping | None) -> Any:
    path = _locate(kind, name_or_path)
    where = _display(path)
    tree = _load_tree(kind, path)
    if overrides:
        if not isinstance(overrides, Mapping):
            raise ConfigError(f"overrides for {where} must be a mapping, got {overrides!r}")
        schema = {k: v for k, v in _SCHEMAS[kind].items() if k != "base"}
        _check_keys(overrides, schema, "overrides")
        tree = _deep_merge(tree, overrides)
        where += " (with overrides)"
    return _BUILDERS[kind](tree, where)


def load_model(name_or_path: str | os.PathLike, overrides: Mapping | None = None) -> ModelSpec:
    """Load a model preset or file.

    Args:
        name_or_path: preset name (``"llama3-8b"``) or path to a YAML file.
        overrides: nested mapping merged over the file, e.g. ``{"seq_len": 4096}``.

    Returns:
        The checked :class:`ModelSpec`; ``name`` defaults to the file name.

    Raises:
        ConfigError: unknown preset or key, bad value, heads not divisible by kv_heads, hidden not
            divisible by heads, moe.top_k > moe.experts.
    """
    return _load_one("models", name_or_path, overrides)


def load_cluster(name_or_path: str | os.PathLike, overrides: Mapping | None = None) -> ClusterSpec:
    """Load a cluster preset or file.

    Args:
        name_or_path: preset name (``"dgx-h100"``) or path to a YAML file.
        overrides: nested mapping merged over the file, e.g. ``{"gpu": {"memory_GiB": 40}}``.

    Returns:
        The checked :class:`ClusterSpec`; ``name`` defaults to the file name.

    Raises:
        ConfigError: unknown preset or key, bad value.
    """
    return _load_one("clusters", name_or_path, overrides)


def load_plan(name_or_path: str | os.PathLike, overrides: Mapping | None = None) -> PlanSpec:
    """Load a plan preset or file.

    Args:
        name_or_path: preset name (``"fsdp"``) or path to a YAML file.
        overrides: nested mapping merged over the file, e.g. ``{"dp": 64}``.

    Returns:
        The checked :class:`PlanSpec` (checks that need no model or cluster only).

    Raises:
        ConfigError: unknown preset or key, bad value, ``order`` not a permutation of the placed
            dimensions, ``chunks`` inconsistent with ``schedule``.
    """
    return _load_one("plans", name_or_path, overrides)


def _merge_overrides(tree: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Merge parsed overrides into an experiment tree; a string section replaces the section."""
    tree = dict(tree)
    for key, value in overrides.items():
        if key in _SECTIONS and isinstance(value, str):
            tree[key] = {"base": _anchor_base(value, Path.cwd())}
        elif key in _SECTIONS and isinstance(value, Mapping) and "base" in value:
            anchored = dict(value, base=_anchor_base(value["base"], Path.cwd()))
            tree[key] = anchored  # a new base replaces the whole section
        elif isinstance(value, Mapping) and isinstance(tree.get(key), Mapping):
            tree[key] = _deep_merge(tree[key], value)
        else:
            tree[key] = value
    return tree


def load_experiment(
    path: str | os.PathLike, overrides: Sequence[str] = (), strict: bool = True
) -> Experiment:
    """Load and validate an experiment: a model, a cluster and a plan.

    The file has keys ``model``, ``cluster`` and ``plan`` (each a preset name or an inline
    mapping, which may hold ``base:``) and optionally ``description`` and ``gpus`` (the number of
    GPUs, which must equal dp*tp*pp*cp).

    Args:
        path: path to the experiment file, or the name of one in ``configs/examples``.
        overrides: ``key=value`` strings with dotted keys, e.g. ``["plan.tp=4",
            "cluster.gpu.memory_GiB=40", "model=llama3-8b"]``.
        strict: passed to :func:`check_plan`; False skips the layer and batch divisibility
            checks (for published runs that do not satisfy them).

    Returns:
        The :class:`Experiment`, with ``source`` naming the file.

    Raises:
        ConfigError: anything :func:`load_model`, :func:`load_cluster`, :func:`load_plan` or
            :func:`validate_experiment` rejects, an unknown override key or a missing section.
    """
    file = _locate("examples", path)
    where = _display(file)
    tree = _load_tree("examples", file)
    parsed = parse_overrides(overrides)
    if parsed:
        _check_keys(parsed, _SCHEMAS["examples"], "overrides")
        tree = _merge_overrides(tree, parsed)
        where += " (with overrides)"
    missing = [s for s in _SECTIONS if tree.get(s) is None]
    if missing:
        raise ConfigError(
            f"{where}: missing required key{'s' if len(missing) > 1 else ''} "
            + ", ".join(f"'{m}'" for m in missing)
            + " (each a preset name or a mapping)"
        )
    specs = {}
    for section, kind in _SECTIONS.items():
        value = tree[section]
        if not isinstance(value, Mapping):
            raise _invalid(where, section, value, "a preset name or a mapping")
        merged = _resolve_base(kind, value, f"{where}: {section}")
        specs[section] = _BUILDERS[kind](_with_name(merged, kind, file.stem), where, f"{section}.")
    gpus = tree.get("gpus")
    if gpus is not None:
        gpus = _check_int(gpus, where, "gpus")
    experiment = Experiment(source=where, **specs)
    validate_experiment(experiment, n_gpus=gpus, strict=strict)
    return experiment


# --------------------------------------------------------------------------------------------
# Cross checks of model, cluster and plan.
# --------------------------------------------------------------------------------------------


# The plan rules and their messages live in ``diffcost.constraints`` (one table for the config
# check, the traced validity mask, the plan space and the search's penalties).
check_plan = constraints.problems


def validate_experiment(exp: Experiment, n_gpus: int | None = None, strict: bool = True) -> None:
    """Raise if the experiment's model, cluster and plan do not fit together.

    Args:
        exp: the experiment; its ``source`` names the file in the message.
        n_gpus: when given, dp*tp*pp*cp must equal it.
        strict: see :func:`check_plan`.

    Raises:
        ConfigError: listing every problem :func:`check_plan` finds.
    """
    problems = check_plan(exp.model, exp.cluster, exp.plan, n_gpus=n_gpus, strict=strict)
    if problems:
        where = exp.source or "experiment"
        raise ConfigError(f"{where}: invalid plan:\n  - " + "\n  - ".join(problems))
