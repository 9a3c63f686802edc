"""Calibrated profiles: layered Params for a cluster, stored as YAML.

Two layers, shipped with the package in ``diffcost/configs/profiles/``:

* **device** constants (kernel efficiencies, launch gap, the rate at which a reducing
  collective passes over its buffer on the GPU, the GEMM and layer shape grids): one set per
  GPU family, shared by every cluster with that GPU (``device-<family>.yaml``);
* **cluster** constants (link efficiencies and latencies, small-message curve, host dispatch,
  interference, optimizer traffic, per-iteration overhead): one set per cluster
  (``<cluster>.yaml``).

``params_for(cluster)`` starts from the datasheet defaults, applies the device file of the
cluster's GPU family when there is one, then the cluster's own file, and says which it used.
Values in the files are the constrained (human) values, not the raw reparametrized leaves.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import yaml

from diffcost import config
from diffcost.gpus import FAMILY_PARENT, gpu_family, preset_family
from diffcost.params import (
    CONSTANTS,
    GEMM_GRID,
    GEMM_GRID_CLASSES,
    GEMM_GRID_LOG2_LO,
    HEAD_GRID,
    HEAD_GRID_LOG2_LO,
    LAYER_GRID,
    LAYER_GRID_LOG2_LO,
    Params,
    default_params,
)
from diffcost.specs import PRECISIONS, ClusterSpec
from diffcost.stacks import EFFECT_BY_NAME, apply_stack
from diffcost.uncertainty import (
    Uncertainty,
    UncertaintyError,
    apply_block,
    at_prior_unless,
    parse_block,
    prior_uncertainty,
)

PROFILES_DIR = config.PACKAGE_CONFIGS / "profiles"
UNCERTAINTY_KEY = "uncertainty"  # a profile's posterior block (diffcost.uncertainty)

# field name in a profile -> (raw leaf, transform): "log" or "logit"
FIELDS = {c.name: (c.leaf, c.transform) for c in CONSTANTS}
DEVICE_FIELDS = tuple(c.name for c in CONSTANTS if c.level == "device")
CLUSTER_FIELDS = tuple(f for f in FIELDS if f not in DEVICE_FIELDS)


class ProfileError(ValueError):
    """A profile file is missing, malformed or names unknown constants."""


class ProfileMismatch(ProfileError):
    """A profile file was fitted on another GPU family than the cluster's."""

    def __init__(self, reason: str, advice: str):
        self.reason = reason  # "P was fitted on K (a100 GPUs) but C has ... GPUs (h100)"
        super().__init__(f"{reason}: {advice}")


def _to_raw(kind: str, value):
    v = np.asarray(value, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):  # out-of-range values become nan
        return np.log(v) if kind == "log" else np.log(v) - np.log1p(-v)


def _from_raw(kind: str, raw):
    r = np.asarray(raw, dtype=float)
    return np.exp(r) if kind == "log" else 1.0 / (1.0 + np.exp(-r))


# The GEMM shape grids are stored sparsely, per precision class: {"high" | "low": {"MxNxK"
# (octave nodes): efficiency factor}}, only the nodes the fit moved; every other node keeps 1.
# The layer shape grids likewise (device and cluster): {"TxWxP" (tokens, width, tp octave nodes):
# time factor}, and the LM head grid as {"TxHxP"} (hidden size second): ``SPARSE_GRIDS``.
GRID_FIELD = "gemm_shape_eff"
LAYER_FIELD = "layer_shape_time"
CLUSTER_LAYER_FIELD = "cluster_layer_time"
HEAD_FIELD = "head_shape_time"
_GRID_DIMS = [2 ** (GEMM_GRID_LOG2_LO + i) for i in range(GEMM_GRID)]
_LAYER_DIMS = [[2 ** (lo + i) for i in range(n)] for lo, n in zip(LAYER_GRID_LOG2_LO, LAYER_GRID)]
_HEAD_DIMS = [[2 ** (lo + i) for i in range(n)] for lo, n in zip(HEAD_GRID_LOG2_LO, HEAD_GRID)]
# the single sparse grids: field -> (node values per axis, node key, what the nodes are)
SPARSE_GRIDS = {
    LAYER_FIELD: (_LAYER_DIMS, "TxWxP", "layer shapes"),
    CLUSTER_LAYER_FIELD: (_LAYER_DIMS, "TxWxP", "layer shapes"),
    HEAD_FIELD: (_HEAD_DIMS, "TxHxP", "LM head shapes"),
}
_GRID_KEEP = 1e-4  # |log factor| below this is written as 1 (left out)


def _nodes(factors: np.ndarray, dims) -> dict:
    """{"AxBxC": factor} of the nodes of a 3-D grid of ``factors`` whose factor is not 1."""
    return {
        "x".join(str(d[i]) for d, i in zip(dims, idx)): round(float(factors[idx]), 5)
        for idx in zip(*np.nonzero(np.abs(np.log(factors)) >= _GRID_KEEP))
    }


def _nodes_raw(nodes, dims, key: str, where: str, what: str) -> np.ndarray:
    """Log factors of a 3-D grid from its {"AxBxC": factor} nodes; every other node 0. ``key``
    ("MxNxK") and ``what`` ("GEMM shapes") name the nodes in messages."""
    if not isinstance(nodes, dict):
        raise ProfileError(f"{where} must map '{key}' {what} to factors")
    raw = np.zeros([len(d) for d in dims])
    for node, factor in nodes.items():
        parts = str(node).split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) in d for p, d in zip(parts, dims)):
            allowed = (f"{a} one of {', '.join(map(str, d))}" for a, d in zip(key.split("x"), dims))
            raise ProfileError(f"{where}.{node}: expected '{key}' with {'; '.join(allowed)}")
        if not isinstance(factor, int | float) or not np.isfinite(factor) or factor <= 0:
            raise ProfileError(f"{where}.{node}={factor!r}: the factor must be a number above 0")
        raw[tuple(d.index(int(p)) for p, d in zip(parts, dims))] = np.log(factor)
    return raw


def _grid_nodes(factors: np.ndarray) -> dict:
    out = {}
    for c, name in enumerate(GEMM_GRID_CLASSES):
        nodes = _nodes(factors[c], [_GRID_DIMS] * 3)
        if nodes:
            out[name] = nodes
    return out


def _grid_raw(value, where: str) -> np.ndarray:
    classes = ", ".join(GEMM_GRID_CLASSES)
    if not isinstance(value, dict):
        raise ProfileError(f"{where} must map precision classes ({classes}) to GEMM shapes")
    raw = np.zeros((len(GEMM_GRID_CLASSES),) + (GEMM_GRID,) * 3)
    for name, nodes in value.items():
        if name not in GEMM_GRID_CLASSES:
            raise ProfileError(f"{where}.{name}: unknown precision class (known: {classes})")
        c = GEMM_GRID_CLASSES.index(name)
        raw[c] = _nodes_raw(nodes, [_GRID_DIMS] * 3, "MxNxK", f"{where}.{name}", "GEMM shapes")
    return raw


def to_values(params: Params, fields=tuple(FIELDS)) -> dict:
    """Constrained values of ``fields`` (``gemm_eff`` as a per-precision mapping)."""
    out = {}
    for name in fields:
        leaf, kind = FIELDS[name]
        v = _from_raw(kind, getattr(params, leaf))
        if name == "gemm_eff":
            out[name] = {p: float(x) for p, x in zip(PRECISIONS, v)}
        elif name == GRID_FIELD:
            out[name] = _grid_nodes(v)
        elif name in SPARSE_GRIDS:
            out[name] = _nodes(v, SPARSE_GRIDS[name][0])
        else:
            out[name] = float(v)
    return out


def apply_values(params: Params, values: dict, where: str = "profile") -> Params:
    """``params`` with the constrained ``values`` replacing their defaults."""
    updates = {}
    for name, value in values.items():
        if name not in FIELDS:
            raise ProfileError(f"{where}: unknown constant '{name}' (known: {', '.join(FIELDS)})")
        leaf, kind = FIELDS[name]
        if name == "gemm_eff":
            current = np.array(getattr(params, leaf), dtype=float)
            if not isinstance(value, dict):
                raise ProfileError(f"{where}: gemm_eff must map precisions to fractions")
            for p, x in value.items():
                if p not in PRECISIONS:
                    raise ProfileError(f"{where}: gemm_eff.{p}: unknown precision")
                current[PRECISIONS.index(p)] = _to_raw(kind, x)
            raw = current
        elif name == GRID_FIELD:
            raw = _grid_raw(value, f"{where}: {name}")
        elif name in SPARSE_GRIDS:
            dims, key, what = SPARSE_GRIDS[name]
            raw = _nodes_raw(value, dims, key, f"{where}: {name}", what)
        else:
            raw = _to_raw(kind, value)
        if not np.all(np.isfinite(raw)):
            valid = "a fraction strictly between 0 and 1" if kind == "logit" else "a number above 0"
            raise ProfileError(f"{where}: {name}={value!r} is out of range: it must be {valid}")
        updates[leaf] = jnp.asarray(raw, dtype=getattr(params, leaf).dtype)
    return params.replace(**updates)


def _read(path: Path) -> dict:
    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh) or {}
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML: {e}") from None
    except IsADirectoryError:
        raise ProfileError(f"{path} is a folder; give a profile file (.yaml)") from None
    if not isinstance(doc, dict) or "constants" not in doc:
        raise ProfileError(f"{path}: expected a mapping with 'constants'")
    return doc


def device_path(family: str) -> Path:
    return PROFILES_DIR / f"device-{family}.yaml"


def device_profile(family: str) -> Path:
    """The device profile ``family`` predicts with: its own, or where it has none its
    ``FAMILY_PARENT``'s (a GPU of the same architecture); the path need not exist."""
    own, relative = device_path(family), FAMILY_PARENT.get(family)
    if not own.exists() and relative and device_path(relative).exists():
        return device_path(relative)
    return own


def cluster_path(cluster: str) -> Path:
    return PROFILES_DIR / f"{cluster}.yaml"


# The cluster constants of a cluster no measurement names: the mean of the clusters the shipped
# fit has end-to-end runs of (``calibration.make_profiles``), not the datasheet defaults.
POPULATION = "population"


def population_path() -> Path:
    return PROFILES_DIR / f"{POPULATION}.yaml"


def stack_path(stack: str) -> Path:
    return PROFILES_DIR / f"stack-{stack}.yaml"


def stack_offsets(stack: str | None) -> tuple[dict, str]:
    """({raw leaf: offset}, note) of a software stack's shipped profile (``stack-<name>.yaml``,
    ``offsets: {constant: raw offset}``); no offsets for None or a stack without a profile,
    which is then the population of stacks the fit saw."""
    if stack is None:
        return {}, "stack not given: the population of fitted stacks"
    path = stack_path(stack)
    if not path.exists():
        return {}, f"no profile for stack {stack}: the population of fitted stacks"
    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh) or {}
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML: {e}") from None
    offsets = doc.get("offsets") if isinstance(doc, dict) else None
    if not isinstance(offsets, dict):
        raise ProfileError(f"{path}: expected a mapping with 'offsets: {{constant: offset}}'")
    out = {}
    for name, value in offsets.items():
        if name not in EFFECT_BY_NAME:
            valid = ", ".join(EFFECT_BY_NAME)
            raise ProfileError(f"{path}: offsets.{name}: not a stack constant (one of {valid})")
        if not isinstance(value, int | float) or not np.isfinite(value):
            raise ProfileError(f"{path}: offsets.{name}={value!r}: expected a finite number")
        out[EFFECT_BY_NAME[name].leaf] = float(value)
    return out, f"stack profile {path.name}"


def profile_family(doc: dict) -> str | None:
    """The GPU family a profile's constants were fitted on: its ``gpu_family`` entry, else the
    family of its ``key`` (a family for a device layer, a cluster preset otherwise); None when
    the file does not say."""
    if doc.get("gpu_family"):
        return str(doc["gpu_family"])
    key = doc.get("key")
    if not key:
        return None
    if doc.get("layer") == "device":
        return str(key)
    return preset_family(str(key))


def _explicit(cluster: ClusterSpec, family: str, path: Path, params: Params):
    """``params`` with the profile file at ``path`` applied, and the note; refuses a profile
    fitted on another GPU family (its kernel constants would be another GPU's)."""
    if not path.exists():
        raise ProfileError(
            f"profile file {path} does not exist (give a file written by diffcost calibrate, "
            "or 'none' for datasheet defaults)"
        )
    doc = _read(path)
    fitted = profile_family(doc)
    key = doc.get("key", "?")
    if fitted is not None and fitted != family:
        raise ProfileMismatch(
            f"{path} was fitted on {key} ({fitted} GPUs) but {cluster.name} has "
            f"{cluster.gpu.name} GPUs ({family})",
            f"give a profile fitted on a cluster with {family} GPUs, or --profile none for "
            "datasheet defaults",
        )
    params = apply_values(params, doc["constants"], str(path))
    names = set(doc["constants"])
    missing = [
        group
        for group, fields in (("device", DEVICE_FIELDS), ("cluster", CLUSTER_FIELDS))
        if not names & set(fields)
    ]
    layer = doc.get("layer", "profile")
    fitted_on = f", fitted on {key}" if key != cluster.name else ""
    note = f"{layer} profile {path.name}{fitted_on}"
    if missing:
        note += f"; {' and '.join(missing)} constants: datasheet defaults"
    return params, note


def params_for(
    cluster: ClusterSpec,
    profile: str | os.PathLike | None = None,
    dtype=None,
    stack: str | None = None,
):
    """(Params, note) for ``cluster``.

    Args:
        profile: None for the default layering (device file, then cluster file, or the
            population file for a cluster without one, then the offsets of ``stack``);
            ``"none"`` for datasheet defaults; or a path to a profile file (applied over the
            datasheet defaults as it is: a profile ``diffcost calibrate`` fitted on a user's
            runs holds their stack; one fitted on another GPU family raises ProfileError).
        stack: the run's software stack (``diffcost.stacks``), for the default layering.

    Returns:
        The Params and a one-line note saying which layers were used and which constants are
        datasheet defaults.
    """
    family = gpu_family(cluster.gpu.name)
    params = default_params(dtype, family)
    if profile is not None and str(profile) == "none":
        return params, "datasheet defaults (--profile none)"
    if profile is not None:
        return _explicit(cluster, family, Path(profile), params)
    used, dev, path = [], device_profile(family), cluster_path(cluster.name)
    if not path.exists() and population_path().exists():
        path = population_path()
    if dev.exists():
        params = apply_values(params, _read(dev)["constants"], str(dev))
        used.append(f"device profile {dev.name}")
    if path.exists():
        params = apply_values(params, _read(path)["constants"], str(path))
        used.append(f"cluster profile {path.name}")
    offsets, stack_note = stack_offsets(stack)
    params = apply_stack(params, offsets)
    if not used:
        note = f"no calibrated profile for {cluster.name} ({family}): datasheet defaults"
        return params, note if stack is None else f"{note}; {stack_note}"
    note = " + ".join(used)
    if not dev.exists():
        note += f"; device constants: datasheet defaults (no profile for {family} GPUs)"
    elif dev != device_path(family):
        note += f" (no profile for {family} GPUs: the {FAMILY_PARENT[family]} family's)"
    if path == population_path():
        note += f" (no profile for {cluster.name}: the mean of the fitted clusters)"
    elif not path.exists():
        note += f"; cluster constants: datasheet defaults (no profile for {cluster.name})"
    return params, f"{note}; {stack_note}"


def population_members(
    cluster: ClusterSpec,
    profile: str | os.PathLike | None = None,
    dtype=None,
    stack: str | None = None,
) -> list[Params]:
    """The Params of each member of the population (the ``members`` of ``population.yaml``:
    the constants of each cluster the shipped fit has end-to-end runs of), layered as
    ``params_for`` layers the population's mean: device file, the member's constants, the
    offsets of ``stack``. A prediction for a cluster without a profile of its own is the
    mean of the members' log times (``diffcost.population``), not the time at the mean
    constants, which is faster (time is convex in them). A profile file that lists
    ``members`` (``diffcost calibrate``'s few-shot refit of a cluster without a profile of
    its own shifts every member of the population alike) gives its members, each applied
    over the file's mean constants as ``params_for`` applies them (no stack offsets: the
    file holds its runs' stack).

    Returns:
        [] unless the default layering (``profile`` None) uses the population file and the
        file lists members (one written before them holds the mean alone: its plug-in), or
        ``profile`` is a file that lists members.

    Raises:
        ProfileError: ``members`` is not a mapping of cluster names to constants, or the
            profile file cannot be used for ``cluster`` (``params_for``).
    """
    return list(population_named(cluster, profile, dtype, stack).values())


def population_named(
    cluster: ClusterSpec,
    profile: str | os.PathLike | None = None,
    dtype=None,
    stack: str | None = None,
) -> dict[str, Params]:
    """``population_members`` by member name (the clusters they are the constants of), in
    the file's order; {} where it gives []."""
    members = _member_constants(cluster, profile)
    if not members:
        return {}
    family = gpu_family(cluster.gpu.name)
    params = default_params(dtype, family)
    if profile is not None:
        path = Path(profile)
        mean, _ = _explicit(cluster, family, path, params)
        return {
            name: apply_values(mean, values, f"{path}: members.{name}")
            for name, values in members.items()
        }
    path, dev = population_path(), device_profile(family)
    if dev.exists():
        params = apply_values(params, _read(dev)["constants"], str(dev))
    offsets, _ = stack_offsets(stack)
    return {
        name: apply_stack(apply_values(params, values, f"{path}: members.{name}"), offsets)
        for name, values in members.items()
    }


def population_size(cluster: ClusterSpec, profile: str | os.PathLike | None = None) -> int:
    """How many members ``population_members`` gives (0: the constants' own prediction)."""
    return len(_member_constants(cluster, profile))


def _member_constants(cluster: ClusterSpec, profile) -> dict:
    """The ``members`` (cluster name -> constants) a prediction on ``cluster`` takes: those of
    the population file under the default layering for a cluster without a profile of its
    own, or those of the profile file given; else {}."""
    if profile is not None:
        path = Path(profile)
        if str(profile) == "none" or not path.is_file():
            return {}  # params_for says what is wrong with a path that is not a file
    else:
        path = population_path()
        if cluster_path(cluster.name).exists() or not path.exists():
            return {}
    members = _read(path).get("members") or {}
    if not isinstance(members, dict) or not all(isinstance(v, dict) for v in members.values()):
        raise ProfileError(f"{path}: members: expected a mapping of clusters to constants")
    return members


def write_profile(
    path: Path, values: dict, meta: dict, uncertainty: dict | None = None,
    members: dict | None = None,
) -> Path:  # fmt: skip
    """Write constrained ``values`` with provenance ``meta`` as a profile file, its
    ``members`` ({name: constrained values}, ``population_members``) and its ``uncertainty``
    block (``diffcost.uncertainty.to_block``) when given."""
    doc = {**meta, "written": datetime.date.today().isoformat(), "constants": values}
    if members:
        doc["members"] = members
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fh.write(f"# diffcost calibrated profile: {meta.get('layer', '')} {meta.get('key', '')}\n")
        yaml.safe_dump(doc, fh, sort_keys=False)
        if uncertainty is not None:  # lists of numbers on one line each
            block = {UNCERTAINTY_KEY: uncertainty}
            yaml.safe_dump(block, fh, sort_keys=False, default_flow_style=None, width=100)
    return path


def _uncertainty_block(unc: Uncertainty, path: Path, doc: dict, layer: str) -> Uncertainty:
    """``unc`` with the ``uncertainty`` block of the profile ``doc`` read from ``path`` applied
    (``layer``: what its coverage describes); ``unc`` itself when the file has none."""
    if UNCERTAINTY_KEY not in doc:
        return unc
    try:
        parsed = parse_block(doc[UNCERTAINTY_KEY], str(path))
    except UncertaintyError as e:
        raise ProfileError(str(e)) from None
    note = f"{unc.note} + {path.name}" if unc.note.endswith(".yaml") else f"posterior {path.name}"
    return apply_block(unc, parsed, layer, note)


def uncertainty_for(cluster: ClusterSpec, profile: str | os.PathLike | None = None) -> Uncertainty:
    """The ``Uncertainty`` of predictions on ``cluster`` with the constants ``params_for``
    gives for the same ``profile``: prior widths, then the device file's posterior block, then
    the cluster file's (which covers the device constants too, with their correlations);
    constants no file gives values for stay at their prior widths.

    Raises:
        ProfileError: a profile file that cannot be read, or whose ``uncertainty`` block is
            malformed (``diffcost.uncertainty.UncertaintyError``).
    """
    unc = prior_uncertainty()
    if profile is not None and str(profile) == "none":
        return unc
    if profile is not None:
        path = Path(profile)
        doc = _read(path)
        layer = "device" if doc.get("layer") == "device" else "cluster"
        return at_prior_unless(_uncertainty_block(unc, path, doc, layer), set(doc["constants"]))
    applied: set = set()
    own = cluster_path(cluster.name)
    if not own.exists() and population_path().exists():
        own = population_path()  # as params_for: the population's constants and spread
    for layer, path in (("device", device_profile(gpu_family(cluster.gpu.name))), ("cluster", own)):
        if path.exists():
            doc = _read(path)
            unc = _uncertainty_block(unc, path, doc, layer)
            applied |= set(doc["constants"])
    return at_prior_unless(unc, applied)


def defaults_table() -> dict:
    """The datasheet defaults in profile form (for reports)."""
    return to_values(default_params())
