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
import difflib
import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from diffcost import constraints
from diffcost.spec_values import (
    BUILDERS,
    SCHEMAS,
    SECTIONS,
    ConfigError,
    check_int,
    invalid,
)
from diffcost.specs import (
    ClusterSpec,
    Experiment,
    ModelSpec,
    PlanSpec,
)
from diffcost.stacks import STACK_NAMES

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


def locate_experiment(name_or_path: str | os.PathLike) -> Path:
    """The file of an experiment named as ``load_experiment`` takes it: a path, a shipped
    example's bare file name (``gpt3-175b.yaml``) or its preset name.

    Raises:
        ConfigError: if no such file or example exists.
    """
    return _locate("examples", name_or_path)


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


def read_yaml(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """A YAML file's top-level mapping (duplicate keys rejected) and its name for messages.

    Raises:
        ConfigError: as ``_read_yaml``.
    """
    path = Path(path).resolve()
    return _read_yaml(path), _display(path)


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
    for section in SECTIONS:
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
    _check_keys(tree, SCHEMAS[kind], where)
    if kind == "examples":
        _normalize_sections(tree, path.parent)
    if not chain and kind in ("models", "clusters") and "name" not in tree:
        tree["name"] = path.stem  # the file loaded names the spec, not its bases
    return _merge_base(kind, tree, where, path.parent, (*chain, path))


def _resolve_base(kind: str, tree: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Resolve a ``base`` key inside an inline mapping (e.g. an experiment's ``model:``)."""
    return _merge_base(kind, dict(tree), where, None, ())


def _merge_base(kind, tree: dict, where: str, relative_to: Path | None, chain) -> dict[str, Any]:
    """``tree`` (its ``base`` key removed) merged over the tree its ``base`` names, if any."""
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ConfigError(f"{where}: base={base!r} must be a preset name or a file path")
    try:
        base_path = _locate(kind, base, relative_to=relative_to)
    except ConfigError as err:
        raise ConfigError(f"{where}: base: {err}") from None
    return _deep_merge(_load_tree(kind, base_path, chain), tree)


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
        schema = {k: v for k, v in SCHEMAS[kind].items() if k != "base"}
        _check_keys(overrides, schema, "overrides")
        tree = _deep_merge(tree, overrides)
        where += " (with overrides)"
    return BUILDERS[kind](tree, where)


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
        if key in SECTIONS and isinstance(value, str):
            tree[key] = {"base": _anchor_base(value, Path.cwd())}
        elif key in SECTIONS and isinstance(value, Mapping) and "base" in value:
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
    mapping, which may hold ``base:``) and optionally ``description``, ``gpus`` (the number of
    GPUs, which must equal dp*tp*pp*cp) and ``stack`` (the training software, a
    ``diffcost.stacks`` name, whose calibrated offsets the prediction then uses).

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
        _check_keys(parsed, SCHEMAS["examples"], "overrides")
        tree = _merge_overrides(tree, parsed)
        where += " (with overrides)"
    missing = [s for s in SECTIONS if tree.get(s) is None]
    if missing:
        raise ConfigError(
            f"{where}: missing required key{'s' if len(missing) > 1 else ''} "
            + ", ".join(f"'{m}'" for m in missing)
            + " (each a preset name or a mapping)"
        )
    specs = {}
    for section, kind in SECTIONS.items():
        value = tree[section]
        if not isinstance(value, Mapping):
            raise invalid(where, section, value, "a preset name or a mapping")
        merged = _resolve_base(kind, value, f"{where}: {section}")
        specs[section] = BUILDERS[kind](_with_name(merged, kind, file.stem), where, f"{section}.")
    gpus = tree.get("gpus")
    if gpus is not None:
        gpus = check_int(gpus, where, "gpus")
    stack = tree.get("stack")
    if stack is not None and stack not in STACK_NAMES:
        raise invalid(where, "stack", stack, f"one of {', '.join(STACK_NAMES)}")
    experiment = Experiment(source=where, stack=stack, **specs)
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
