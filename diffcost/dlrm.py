"""DLRM workloads: embedding tables, the dense part, and their strict YAML description.

A DLRM (Naumov et al. 2019) has a dense part (a bottom MLP over the dense features, an
interaction of its output with the pooled embeddings, a top MLP) and a sparse part: one
embedding table per categorical feature, each looked up ``pooling`` times per sample (multi-
hot) and sum-pooled to one vector. The dense part is small and trained data parallel; the
tables are large and sharded across the GPUs (``diffcost.dlrm_cost``).

Each table carries the shape of its lookups: rows, dimension, mean pooling factor, and the
exponent ``zipf`` of a Zipf law over its rows (0: uniform). The exponent sets how many
lookups a GPU's L2 cache serves (``cache_hit_rate``), Lin et al.'s data-distribution-aware
embedding-lookup model.

Files live in ``configs/dlrm/`` (preset names) or anywhere (paths); see ``load_dlrm``.
Unknown keys are errors with a suggestion, and every bad value names the file, the field, the
value and what would be valid.

References:
    Naumov et al., "Deep Learning Recommendation Model for Personalization and Recommendation
    Systems" (2019); Wang et al., "DCN V2" (2021); Lin et al., "Building a Performance Model for
    Deep Learning Recommendation Model Training on GPUs" (HiPC 2022).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import struct

from diffcost import config, smooth
from diffcost.gpus import gpu_family
from diffcost.spec_values import ConfigError, check_choice, check_int, invalid
from diffcost.specs import PRECISIONS, ClusterSpec

KIND = "dlrm"  # the folder of the presets under ``config.configs_dir()``
INTERACTIONS = ("dcn", "dot")
# Optimizer state per embedding parameter, in parameters: plain SGD none, row-wise Adagrad
# one per row (negligible), Adagrad one per parameter, Adam two.
OPTIMIZER_STATE = {"sgd": 0.0, "rowwise_adagrad": 0.0, "adagrad": 1.0, "adam": 2.0}
# L2 cache of a GPU family, MiB (datasheets); families not listed get ``DEFAULT_L2_MIB``.
L2_MIB = {"v100": 6.0, "a100": 40.0, "h100": 50.0, "h200": 50.0, "b200": 126.0, "gb200": 126.0}
DEFAULT_L2_MIB = 40.0
# L2 bandwidth as a multiple of HBM bandwidth (A100: ~5 TB/s L2 against 2 TB/s HBM; H100
# similar). An assumption shared by every family, not a calibrated constant.
L2_TO_HBM_BANDWIDTH = 2.5

_TOP_KEYS = (
    "description",
    "batch_size",
    "dense_features",
    "bottom_mlp",
    "top_mlp",
    "interaction",
    "cross_layers",
    "cross_rank",
    "embedding_dim",
    "embedding_bytes",
    "exchange_bytes",
    "grad_bytes",
    "precision",
    "optimizer",
    "zipf",
    "tables",
)
_TABLE_KEYS = ("name", "rows", "dim", "pooling", "zipf")


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table: ``rows`` x ``dim``, looked up ``pooling`` times per sample on
    average, rows drawn from a Zipf law of exponent ``zipf`` (0: uniform)."""

    name: str
    rows: int
    dim: int
    pooling: float
    zipf: float


@dataclasses.dataclass(frozen=True)
class DlrmSpec:
    """A DLRM: its tables, dense part and global batch (see ``load_dlrm`` for the fields)."""

    name: str
    tables: tuple[TableSpec, ...]
    batch_size: int
    dense_features: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    interaction: str = "dcn"
    cross_layers: int = 3
    cross_rank: int = 512
    embedding_bytes: int = 4
    precision: str = "fp16"
    optimizer: str = "adagrad"
    exchange_bytes: int | None = None  # None: ``embedding_bytes``
    grad_bytes: int = 4

    @property
    def interaction_width(self) -> int:
        """Width of the interaction's input: the bottom MLP's output and every pooled table."""
        return self.bottom_mlp[-1] + sum(t.dim for t in self.tables)


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------


def _unknown(key, valid, where, prefix="") -> ConfigError:
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else "; valid: " + ", ".join(valid)
    return ConfigError(f"unknown key '{prefix}{key}' in {where}{hint}")


def _number(value, where, path, allow_zero=False) -> float:
    bound = "a number >= 0" if allow_zero else "a number > 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(where, path, value, f"{bound} (got {type(value).__name__})")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise invalid(where, path, value, bound)
    return float(value)


def _layers(value, where, path) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise invalid(where, path, value, "a non-empty list of layer widths, e.g. [512, 256]")
    return tuple(check_int(v, where, f"{path}[{i}]") for i, v in enumerate(value))


def _table(entry, index, defaults, where) -> TableSpec:
    path = f"tables[{index}]"
    if not isinstance(entry, Mapping):
        raise invalid(where, path, entry, "a mapping {rows: N, pooling: L[, dim, zipf, name]}")
    for key in entry:
        if key not in _TABLE_KEYS:
            raise _unknown(key, _TABLE_KEYS, where, path + ".")
    for key in ("rows", "pooling"):
        if key not in entry:
            raise ConfigError(f"{where}: missing required key '{path}.{key}'")
    dim = entry.get("dim", defaults["embedding_dim"])
    if dim is None:
        raise ConfigError(f"{where}: {path}.dim missing and no top-level embedding_dim")
    name = entry.get("name", f"t{index}")
    if not isinstance(name, str) or not name:
        raise invalid(where, f"{path}.name", name, "a non-empty string")
    return TableSpec(
        name=name,
        rows=check_int(entry["rows"], where, f"{path}.rows"),
        dim=check_int(dim, where, f"{path}.dim"),
        pooling=_number(entry["pooling"], where, f"{path}.pooling"),
        zipf=_number(entry.get("zipf", defaults["zipf"]), where, f"{path}.zipf", allow_zero=True),
    )


def dlrm_from_tree(tree: Mapping[str, Any], where: str, name: str) -> DlrmSpec:
    """Check a parsed DLRM file and build its ``DlrmSpec``.

    Raises:
        ConfigError: an unknown or missing key, a bad value, or table dimensions that do not
            match the bottom MLP's output (the interaction needs equal widths).
    """
    if not isinstance(tree, Mapping):
        raise ConfigError(f"{where}: the top level must be a mapping of keys to values")
    for key in tree:
        if key not in _TOP_KEYS:
            raise _unknown(key, _TOP_KEYS, where)
    required = ("batch_size", "dense_features", "bottom_mlp", "top_mlp", "tables")
    missing = [k for k in required if k not in tree]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) " + ", ".join(map(repr, missing)))
    tables = tree["tables"]
    if not isinstance(tables, list) or not tables:
        raise invalid(where, "tables", tables, "a non-empty list of table mappings")
    defaults = {"embedding_dim": tree.get("embedding_dim"), "zipf": tree.get("zipf", 0.0)}
    spec = DlrmSpec(
        name=name,
        tables=tuple(_table(t, i, defaults, where) for i, t in enumerate(tables)),
        batch_size=check_int(tree["batch_size"], where, "batch_size"),
        dense_features=check_int(tree["dense_features"], where, "dense_features"),
        bottom_mlp=_layers(tree["bottom_mlp"], where, "bottom_mlp"),
        top_mlp=_layers(tree["top_mlp"], where, "top_mlp"),
        interaction=check_choice(
            tree.get("interaction", "dcn"), INTERACTIONS, where, "interaction"
        ),
        cross_layers=check_int(tree.get("cross_layers", 3), where, "cross_layers"),
        cross_rank=check_int(tree.get("cross_rank", 512), where, "cross_rank"),
        embedding_bytes=check_choice(
            tree.get("embedding_bytes", 4), (2, 4), where, "embedding_bytes"
        ),
        precision=check_choice(tree.get("precision", "fp16"), PRECISIONS, where, "precision"),
        optimizer=check_choice(
            tree.get("optimizer", "adagrad"), tuple(OPTIMIZER_STATE), where, "optimizer"
        ),
        exchange_bytes=None
        if tree.get("exchange_bytes") is None
        else check_choice(tree["exchange_bytes"], (2, 4), where, "exchange_bytes"),
        grad_bytes=check_choice(tree.get("grad_bytes", 4), (2, 4), where, "grad_bytes"),
    )
    width = spec.bottom_mlp[-1]
    for i, t in enumerate(spec.tables):
        if t.dim != width:
            raise invalid(
                where, f"tables[{i}].dim", t.dim,
                f"{width}, the bottom MLP's output width (the {spec.interaction} interaction "
                "combines vectors of one width)",
            )  # fmt: skip
    return spec


def locate_dlrm(name_or_path: str | os.PathLike) -> Path:
    """The file of a DLRM preset name (``configs/dlrm/NAME.yaml``) or path.

    Raises:
        ConfigError: no such preset or file (the message lists the presets).
    """
    text = os.fspath(name_or_path)
    if "/" in text or text.endswith((".yaml", ".yml")):
        path = Path(text).expanduser()
        if path.is_file():
            return path.resolve()
        shipped = config.configs_dir() / KIND / text
        if shipped.is_file():
            return shipped.resolve()
        raise ConfigError(f"DLRM file not found: {path}")
    path = config.configs_dir() / KIND / f"{text}.yaml"
    if not path.is_file():
        presets = available_dlrm()
        close = difflib.get_close_matches(text, presets, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"unknown DLRM preset {text!r}{hint} Available presets in {path.parent}: "
            + (", ".join(presets) or "(none)")
        )
    return path.resolve()


def available_dlrm() -> list[str]:
    """Names of the DLRM presets shipped in ``configs/dlrm/``."""
    folder = config.configs_dir() / KIND
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def load_dlrm(name_or_path: str | os.PathLike, overrides: Mapping | None = None) -> DlrmSpec:
    """Load a DLRM preset or file.

    Keys: ``batch_size`` (global samples per iteration), ``dense_features``, ``bottom_mlp`` and
    ``top_mlp`` (layer widths after the input), ``interaction`` (``dcn``: DCNv2 low-rank cross
    layers, ``cross_layers`` of rank ``cross_rank``; ``dot``: pairwise dot products),
    ``embedding_dim`` and ``zipf`` (defaults of the tables), ``embedding_bytes`` (4: fp32
    tables, 2: 16-bit), ``exchange_bytes`` (bytes per value of the pooled embeddings and their
    gradients in the all-to-all; default ``embedding_bytes``; 2 where a mixed-precision
    implementation exchanges them in 16 bits, as HugeCTR does), ``grad_bytes`` (bytes per value
    of the dense and replicated-table gradients in the all-reduce; default 4),
    ``precision`` of the dense GEMMs, ``optimizer`` of the tables (one of
    ``OPTIMIZER_STATE``), and ``tables``: a list of ``{rows, pooling[, dim, zipf, name]}``.

    Args:
        name_or_path: a preset name (``"dlrm-dcnv2"``) or a YAML path.
        overrides: top-level keys replaced after reading (e.g. ``{"batch_size": 55296}``).

    Returns:
        The checked ``DlrmSpec``, named after the file.

    Raises:
        ConfigError: see ``dlrm_from_tree``; invalid YAML; a missing file.

    Examples:
        >>> spec = load_dlrm("dlrm-dcnv2")
        >>> len(spec.tables), spec.tables[0].rows, spec.interaction_width
        (26, 40000000, 3456)
    """
    path = locate_dlrm(name_or_path)
    where = path.name
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: invalid YAML: {err}") from None
    if overrides:
        tree = {**tree, **overrides}
        where += " (with overrides)"
    return dlrm_from_tree(tree, where, path.stem)


# ------------------------------------------------------------------------------------------
# Arrays
# ------------------------------------------------------------------------------------------


@struct.dataclass
class TableArrays:
    """The tables as float leaves, one entry per table ``[T]``."""

    rows: jax.Array
    dim: jax.Array
    pooling: jax.Array
    zipf: jax.Array


@struct.dataclass
class DlrmArrays:
    """A DLRM as float leaves.

    ``gemms`` is ``[G, 2]``: the (n, k) of each dense GEMM of one sample's forward pass (the
    batch is m); ``elementwise_bytes`` the forward HBM bytes per sample of the dense part's
    memory-bound kernels (DCN's products and sums, activations).
    """

    tables: TableArrays
    batch: jax.Array  # global samples per iteration
    gemms: jax.Array
    dense_params: jax.Array
    elementwise_bytes: jax.Array
    embedding_bytes: jax.Array
    exchange_bytes: jax.Array  # per value of the pooled embeddings and their gradients
    grad_bytes: jax.Array  # per value of the all-reduced gradients
    optimizer_state: jax.Array  # state parameters per table parameter
    precision: jax.Array  # [n_precisions] one-hot of the dense GEMMs' precision
    l2_bytes: jax.Array


def dense_gemms(spec: DlrmSpec) -> list[tuple[int, int]]:
    """(n, k) of every dense GEMM of the forward pass (weights ``k x n``, batch rows m)."""
    out = []
    width = spec.dense_features
    for w in spec.bottom_mlp:
        out.append((w, width))
        width = w
    x = spec.interaction_width
    if spec.interaction == "dcn":
        for _ in range(spec.cross_layers):  # x0 * (U (V^T x) + b) + x
            out += [(spec.cross_rank, x), (x, spec.cross_rank)]
        width = x
    else:  # dot: the pairwise products of the F vectors, then the bottom output beside them
        f = len(spec.tables) + 1
        out.append((f, spec.bottom_mlp[-1] * f))  # batched F x d @ d x F, as one GEMM's FLOPs
        width = spec.bottom_mlp[-1] + f * (f - 1) // 2
    for w in spec.top_mlp:
        out.append((w, width))
        width = w
    return out


def _elementwise_bytes(spec: DlrmSpec) -> float:
    """Forward HBM bytes per sample of the memory-bound kernels (16-bit activations): each
    layer's bias + activation (read and write), DCN's ``x0 * y + x`` (three reads, a write)."""
    widths = list(spec.bottom_mlp) + list(spec.top_mlp)
    cross = spec.cross_layers * 4 * spec.interaction_width if spec.interaction == "dcn" else 0
    return 2.0 * (2 * sum(widths) + cross)


def dlrm_arrays(spec: DlrmSpec, cluster: ClusterSpec, dtype=None) -> DlrmArrays:
    """Convert a ``DlrmSpec`` (and the L2 size of ``cluster``'s GPU) to float leaves."""
    dtype = jnp.result_type(float) if dtype is None else dtype
    f = lambda v: np.asarray(v, dtype=dtype)  # noqa: E731
    gemms = dense_gemms(spec)
    l2_mib = L2_MIB.get(gpu_family(cluster.gpu.name), DEFAULT_L2_MIB)
    precision = np.zeros(len(PRECISIONS))
    precision[PRECISIONS.index(spec.precision)] = 1.0
    return DlrmArrays(
        tables=TableArrays(
            rows=f([t.rows for t in spec.tables]),
            dim=f([t.dim for t in spec.tables]),
            pooling=f([t.pooling for t in spec.tables]),
            zipf=f([t.zipf for t in spec.tables]),
        ),
        batch=f(spec.batch_size),
        gemms=f(gemms),
        dense_params=f(sum(n * k + n for n, k in gemms)),
        elementwise_bytes=f(_elementwise_bytes(spec)),
        embedding_bytes=f(spec.embedding_bytes),
        exchange_bytes=f(
            spec.embedding_bytes if spec.exchange_bytes is None else spec.exchange_bytes
        ),
        grad_bytes=f(spec.grad_bytes),
        optimizer_state=f(OPTIMIZER_STATE[spec.optimizer]),
        precision=f(precision),
        l2_bytes=f(l2_mib * 2**20),
    )


# ------------------------------------------------------------------------------------------
# Data-distribution-aware lookups
# ------------------------------------------------------------------------------------------


def _harmonic(n, s):
    """Generalized harmonic number ``H(n, s) = sum_{i<=n} i^-s`` by its integral
    ``1 + int_1^n x^-s dx`` (exact at n = 1; ``ln n`` at s = 1, through a smooth ``expm1``)."""
    log_n = jnp.log(jnp.maximum(n, 1.0))
    u = (1.0 - s) * log_n
    small = jnp.abs(u) < 1e-6
    safe = jnp.where(small, 1.0, u)
    ratio = jnp.where(small, 1.0 + 0.5 * u, jnp.expm1(safe) / safe)  # (e^u - 1) / u
    return 1.0 + log_n * ratio


def cache_hit_rate(rows, row_bytes, zipf, l2_bytes):
    """Fraction of lookups into ``rows`` rows of ``row_bytes`` that the L2 cache serves.

    The cache holds the ``C = l2_bytes / row_bytes`` most frequent rows; under a Zipf law of
    exponent ``s`` over the rows they take ``H(C, s) / H(rows, s)`` of the lookups (``C /
    rows`` for uniform lookups, all of them when the table fits). Lin et al. model the lookup
    kernel's effective bandwidth from the hit rate the index distribution implies; the Zipf
    law is this model's parametric form of that distribution.

    Args:
        rows, row_bytes, zipf: arrays (broadcast); ``l2_bytes``: the cache size.

    Returns:
        Hit rate in [0, 1], shaped like the broadcast inputs.
    """
    cached = smooth.clip_exact(l2_bytes / row_bytes, 0.0, rows)  # exact: a table fits or not
    return smooth.clip_exact(_harmonic(cached, zipf) / _harmonic(rows, zipf), 0.0, 1.0)
