"""Values of config trees: type and range checks, and the spec dataclasses built from them.

:mod:`diffcost.config` locates, reads, merges and overrides YAML trees; this module checks each
leaf against its dataclass field (type, range, choices) and builds ``ModelSpec``,
``ClusterSpec`` and ``PlanSpec``. Every error is a :class:`ConfigError` naming the file, the
dotted field path, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from diffcost.constraints import divisors, join
from diffcost.specs import (
    PLACED_DIMS,
    PRECISIONS,
    TRANSPORTS,
    ZERO_STAGES,
    ClusterSpec,
    GpuSpec,
    ModelSpec,
    MoeSpec,
    PlanSpec,
)
from diffcost.topology import INTRA_NODE

# Keys that document a file and are accepted even where the dataclass has no such field.
DOC_KEYS = ("description",)
# Floating-point fields that may be zero; every other number must be positive.
_NON_NEGATIVE = frozenset({"nvlink_latency_us", "nic_latency_us", "offload_fraction"})


class ConfigError(ValueError):
    """A configuration file, preset name or override is invalid.

    The message names the file (when there is one), the dotted field path, the bad value and
    what would be valid.
    """


def _leaf_keys(cls: type, *extra: str) -> dict[str, Any]:
    return {**{f.name: None for f in dataclasses.fields(cls)}, **{k: None for k in extra}}


# Which keys each kind of file may hold. A value of ``None`` is a leaf; a mapping is a nested
# section whose keys are checked in turn.
SECTIONS = {"model": "models", "cluster": "clusters", "plan": "plans"}
_GPU_SCHEMA = {**_leaf_keys(GpuSpec), "peak_tflops": {p: None for p in PRECISIONS}}
SCHEMAS: dict[str, dict[str, Any]] = {
    "models": {**_leaf_keys(ModelSpec, "base", *DOC_KEYS), "moe": _leaf_keys(MoeSpec)},
    "clusters": {**_leaf_keys(ClusterSpec, "base", *DOC_KEYS), "gpu": _GPU_SCHEMA},
    "plans": _leaf_keys(PlanSpec, "base", *DOC_KEYS),
}
SCHEMAS["examples"] = {
    "base": None,
    "description": None,
    "gpus": None,
    "stack": None,
    **{section: SCHEMAS[kind] for section, kind in SECTIONS.items()},
}


def invalid(where: str, path: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{where}: {path}={value!r} is invalid: expected {expected}")


def check_int(value: Any, where: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(where, path, value, f"a positive integer (got {type(value).__name__})")
    if value < 1:
        raise invalid(where, path, value, "a positive integer")
    return value


def _check_float(value: Any, where: str, path: str, allow_zero: bool = False) -> float:
    bound = "a number >= 0" if allow_zero else "a number > 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str) and _looks_numeric(value):
            hint = f"; YAML reads {value} as text, write it with a '.' before the 'e', e.g. 1.0e+3"
        raise invalid(where, path, value, f"{bound} (got {type(value).__name__}{hint})")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise invalid(where, path, value, bound)
    return float(value)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_bool(value: Any, where: str, path: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(where, path, value, "true or false")
    return value


def _check_str(value: Any, where: str, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(where, path, value, "a non-empty string")
    return value


def check_choice(value: Any, choices: Sequence[Any], where: str, path: str) -> Any:
    if isinstance(value, bool) or value not in choices:
        raise invalid(where, path, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def _check_scalar(name: str, hint: Any, value: Any, where: str, path: str) -> Any:
    """Check one leaf value against its dataclass type annotation."""
    arms = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    if type(None) in arms:  # ``X | None``: null is allowed, anything else is checked as X
        if value is None:
            return None
        (hint,) = [arm for arm in arms if arm is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return check_choice(value, typing.get_args(hint), where, path)
    if hint is bool:
        return _check_bool(value, where, path)
    if hint is int:
        return check_int(value, where, path)
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
        tree: merged mapping; keys not among the fields must be ``DOC_KEYS``.
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
        raise invalid(where, path, value, "a mapping {experts: N, top_k: K} or null")
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
    if model.head_tokens > 1.0:
        raise invalid(where, f"{prefix}head_tokens", model.head_tokens, "a fraction in (0, 1]")
    if model.heads % model.kv_heads:
        raise ConfigError(
            f"{where}: {prefix}heads={model.heads} is not divisible by "
            f"{prefix}kv_heads={model.kv_heads}; kv_heads must divide heads "
            f"(valid kv_heads: {join(divisors(model.heads))})"
        )
    if model.hidden % model.heads:
        raise ConfigError(
            f"{where}: {prefix}hidden={model.hidden} is not divisible by "
            f"{prefix}heads={model.heads} (head size would be {model.hidden / model.heads:g}); "
            f"valid heads: {join(divisors(model.hidden))}"
        )
    return model


def _peak_tflops(value: Any, where: str, path: str) -> dict[str, float]:
    if not isinstance(value, Mapping) or not value:
        raise invalid(
            where,
            path,
            value,
            f"a mapping from precision ({join(PRECISIONS)}) to dense TFLOP/s, e.g. {{bf16: 312}}",
        )
    peaks = {}
    for precision, tflops in value.items():
        check_choice(precision, PRECISIONS, where, f"{path} key")
        peaks[precision] = _check_float(tflops, where, f"{path}.{precision}")
    return peaks


def _cluster_from_tree(tree: Mapping[str, Any], where: str, prefix: str = "") -> ClusterSpec:
    """Build and check a :class:`ClusterSpec` (with its nested ``gpu:``) from a mapping."""

    def gpu(value: Any, path: str) -> GpuSpec:
        if not isinstance(value, Mapping):
            raise invalid(where, path, value, "a mapping with " + join(_GPU_SCHEMA))

        def peaks(v: Any, p: str) -> dict[str, float]:
            return _peak_tflops(v, where, p)

        return _build(GpuSpec, value, where, path + ".", {"peak_tflops": peaks})

    cluster = _build(ClusterSpec, tree, where, prefix, {"gpu": gpu})
    topology = INTRA_NODE.get(
        check_choice(cluster.intra_node, tuple(INTRA_NODE), where, f"{prefix}intra_node")
    )
    check_choice(cluster.transport, TRANSPORTS, where, f"{prefix}transport")
    if why := topology.node_error_fn(cluster.gpus_per_node):
        raise ConfigError(
            f"{where}: {prefix}gpus_per_node={cluster.gpus_per_node} does not fit "
            f"{prefix}intra_node={cluster.intra_node!r}: {why}"
        )
    return cluster


def _plan_from_tree(tree: Mapping[str, Any], where: str, prefix: str = "") -> PlanSpec:
    """Build and check a :class:`PlanSpec` from a merged mapping."""

    def zero(value: Any, path: str) -> int:
        return check_choice(value, ZERO_STAGES, where, path)

    def order(value: Any, path: str) -> tuple[str, ...]:
        expected = f"a permutation of [{', '.join(PLACED_DIMS)}] (innermost first)"
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise invalid(where, path, value, expected)
        if sorted(value) != sorted(PLACED_DIMS):
            raise invalid(where, path, list(value), expected)
        return tuple(value)

    plan = _build(PlanSpec, tree, where, prefix, {"zero": zero, "order": order})
    if not 0.0 < plan.recompute_fraction <= 1.0:
        raise invalid(
            where,
            f"{prefix}recompute_fraction",
            plan.recompute_fraction,
            "a fraction in (0, 1]: the share of the layers recompute applies to",
        )
    if not plan.offload_fraction < 1.0:
        raise invalid(
            where,
            f"{prefix}offload_fraction",
            plan.offload_fraction,
            "a fraction in [0, 1): the share of the layers whose activations go to host memory "
            "(Megatron-Core offloads fewer layers than it has)",
        )
    if plan.param_gather == "layer" and plan.zero != 2:
        raise ConfigError(
            f"{where}: {prefix}param_gather='layer' applies to ZeRO-2 (FSDP SHARD_GRAD_OP), "
            f"but {prefix}zero={plan.zero}; use zero: 2, or leave param_gather out"
        )
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


BUILDERS = {"models": _model_from_tree, "clusters": _cluster_from_tree, "plans": _plan_from_tree}
