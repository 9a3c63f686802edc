"""Measurement records, the collection that holds them, and what every reader shares.

The readers (:mod:`calibration.readers` for CSV tables, :mod:`calibration.nccl_tests` for raw
nccl-tests output) turn files into these records; every record keeps the file and 1-based line
it came from. Values are SI (seconds, bytes).
"""

from __future__ import annotations

import csv
import dataclasses
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator

from diffcost.gpus import FAMILY_CLUSTER, gpu_family, preset_family
from diffcost.runs import CsvLineError, data_rows, number_error
from diffcost.specs import ClusterSpec, ModelSpec, PlanSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
FIT_PRECISIONS = ("bf16", "fp16", "fp8", "fp4")  # GEMM precisions the fit uses
NCCL_TESTS_SOURCE = "nccl-tests"


class ReaderError(ValueError):
    """Malformed input; the message starts with ``file:line:``."""

    def __init__(self, file, line: int | None, message: str):
        self.file = str(file)
        self.line = line
        where = f"{self.file}:{line}" if line is not None else self.file
        super().__init__(f"{where}: {message}")


def open_file(path, **kwargs):
    """``open(path)``; a missing path or a directory is a :class:`ReaderError` naming it."""
    try:
        return open(path, **kwargs)
    except FileNotFoundError:
        raise ReaderError(path, None, "no such file") from None
    except IsADirectoryError:
        raise ReaderError(
            path, None, "is a directory, not a file (load() reads the files in a directory)"
        ) from None


# --------------------------------------------------------------------------------------------
# Records


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a record comes from: file and 1-based line (the CSV header is line 1)."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One timed collective: ``time_s`` for a ``size_bytes`` buffer (nccl-tests "size")."""

    collective: str  # one of COLLECTIVES
    size_bytes: float
    group_size: int
    per_node: int  # ranks of one group in one node
    n_nodes: int  # nodes one group spans
    n_groups: int  # groups (send/recv: transfers) running at the same time
    cluster: str | None  # preset name, None if unknown
    dtype: str  # "fp32", "bf16", "fp16", ...
    time_s: float
    source_name: str  # data set: CSV 'source' column, or "nccl-tests"
    where: Source


@dataclasses.dataclass(frozen=True)
class GemmRecord:
    """One timed (batched) GEMM: ``batch`` products of (m x k) . (k x n)."""

    gpu: str  # GPU family key ("h100", "b200", "mi350", ...)
    batch: int
    m: int
    n: int
    k: int
    precision: str  # "fp32", "bf16", "fp16", "fp8"
    time_s: float
    where: Source
    dtype: str = ""  # element types as the file writes them, e.g. "f8e4m3fnxf8e5m2->bf16"
    source_name: str = ""  # CSV 'source' column
    sustained: bool = False  # timed under sustained load (SimuMax table column 'load')


@dataclasses.dataclass(frozen=True)
class AttentionRecord:
    """One timed fused attention kernel (forward or backward) of ``batch`` sequences of
    ``seq_len`` tokens, ``heads`` query and ``kv_heads`` key/value heads on one GPU.

    ``head_dim`` is the mean of the query/key and value head dims, so the model's FLOP count
    ``4 batch seq_len^2 heads head_dim`` (the full square) is the kernel's.
    """

    gpu: str  # GPU family key
    stage: str  # "fwd" or "bwd"
    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: float
    causal: bool
    time_s: float
    where: Source
    source_name: str = ""
    sustained: bool = False  # timed under sustained load (SimuMax table column 'load')


@dataclasses.dataclass(frozen=True)
class MemoryRecord:
    """One memory-bound transfer: ``n_bytes`` through HBM in ``time_s`` on ``cluster``."""

    gpu: str  # GPU family key
    cluster: str  # preset whose HBM bandwidth the time is compared with
    n_bytes: float
    time_s: float
    where: Source
    source_name: str = ""


@dataclasses.dataclass(frozen=True)
class E2ERecord:
    """One measured training run, as the simulator's specs."""

    model: ModelSpec
    plan: PlanSpec
    cluster: ClusterSpec
    measured_iter_s: float
    source_name: str
    row: int  # 1-based data row (line - 1 for files without multi-line cells)
    defaults: tuple[str, ...]  # values filled in because the source left them out
    where: Source
    stack: str | None = None  # diffcost.stacks name of the run's framework (None: unknown)


def _as_set(value) -> set[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return {value}
    return set(value)


@dataclasses.dataclass
class Measurements:
    """Records of every kind, plus the rows that could not be represented."""

    e2e: list[E2ERecord] = dataclasses.field(default_factory=list)
    collectives: list[CollectiveRecord] = dataclasses.field(default_factory=list)
    gemms: list[GemmRecord] = dataclasses.field(default_factory=list)
    attention: list[AttentionRecord] = dataclasses.field(default_factory=list)
    memory: list[MemoryRecord] = dataclasses.field(default_factory=list)
    skipped: list[tuple[Source, str]] = dataclasses.field(default_factory=list)

    def __add__(self, other: Measurements) -> Measurements:
        if not isinstance(other, Measurements):
            return NotImplemented
        return Measurements(
            e2e=self.e2e + other.e2e,
            collectives=self.collectives + other.collectives,
            gemms=self.gemms + other.gemms,
            attention=self.attention + other.attention,
            memory=self.memory + other.memory,
            skipped=self.skipped + other.skipped,
        )

    def __radd__(self, other):  # sum([...]) starts from 0
        if other == 0:
            return self
        return NotImplemented

    def __len__(self) -> int:
        kernels = len(self.gemms) + len(self.attention) + len(self.memory)
        return len(self.e2e) + len(self.collectives) + kernels

    def filter(self, cluster=None, gpu=None, sources=None) -> Measurements:
        """The records matching every given criterion (each a name or an iterable of names).

        * ``cluster``: preset names. E2E, collective and memory records by their cluster; GEMM
          and attention kernel records by the GPU family of those presets (they carry none).
        * ``gpu``: GPU family keys (``"h100"``; full names are reduced with :func:`gpu_family`).
          Collective records by the GPU of their cluster preset; records without a cluster, or
          whose preset cannot be loaded, do not match.
        * ``sources``: data-set names (``source_name``).

        ``skipped`` is kept whole (it has no such attributes).
        """
        clusters = _as_set(cluster)
        gpus = None if gpu is None else {gpu_family(g) for g in _as_set(gpu)}
        srcs = _as_set(sources)
        cluster_gpus = None
        if clusters is not None:
            cluster_gpus = {f for f in (preset_family(c) for c in clusters) if f is not None}

        def keep_e2e(r: E2ERecord) -> bool:
            return (
                (clusters is None or r.cluster.name in clusters)
                and (gpus is None or gpu_family(r.cluster.gpu.name) in gpus)
                and (srcs is None or r.source_name in srcs)
            )

        def keep_coll(r: CollectiveRecord) -> bool:
            return (
                (clusters is None or r.cluster in clusters)
                and (gpus is None or (r.cluster is not None and preset_family(r.cluster) in gpus))
                and (srcs is None or r.source_name in srcs)
            )

        def keep_e2e_name(name: str) -> bool:
            return clusters is None or name in clusters

        def keep_gemm(r: GemmRecord | AttentionRecord | MemoryRecord) -> bool:
            return (
                (cluster_gpus is None or r.gpu in cluster_gpus)
                and (gpus is None or r.gpu in gpus)
                and (srcs is None or r.source_name in srcs)
            )

        return Measurements(
            e2e=[r for r in self.e2e if keep_e2e(r)],
            collectives=[r for r in self.collectives if keep_coll(r)],
            gemms=[r for r in self.gemms if keep_gemm(r)],
            attention=[r for r in self.attention if keep_gemm(r)],
            memory=[r for r in self.memory if keep_gemm(r) and keep_e2e_name(r.cluster)],
            skipped=list(self.skipped),
        )

    def counts(self) -> dict:
        """Record counts per kind and skip counts per reason."""
        return {
            "e2e": len(self.e2e),
            "collectives": len(self.collectives),
            "gemms": len(self.gemms),
            "attention": len(self.attention),
            "memory": len(self.memory),
            "skipped": dict(Counter(reason for _, reason in self.skipped).most_common()),
        }


def placed_kernels(meas: Measurements, warn: bool = False) -> Measurements:
    """``meas`` with the GEMM and attention rows of GPU families that have no preset to time
    them on (``diffcost.gpus.FAMILY_CLUSTER``) moved to ``skipped``, with the reason; ``warn``:
    also a ``UserWarning`` naming the rows left out."""
    known = ", ".join(sorted(FAMILY_CLUSTER))
    skipped = list(meas.skipped)
    for r in meas.gemms + meas.attention:
        if r.gpu not in FAMILY_CLUSTER:
            reason = f"kernel of {r.gpu} GPUs: no preset to time it on (families: {known})"
            skipped.append((r.where, reason))
    dropped = skipped[len(meas.skipped) :]
    if warn and dropped:
        where = "; ".join(f"{src}: {reason}" for src, reason in dropped[:3])
        more = f" (and {len(dropped) - 3} more)" if len(dropped) > 3 else ""
        warnings.warn(f"{len(dropped)} kernel rows left out: {where}{more}", stacklevel=3)
    return dataclasses.replace(
        meas,
        gemms=[r for r in meas.gemms if r.gpu in FAMILY_CLUSTER],
        attention=[r for r in meas.attention if r.gpu in FAMILY_CLUSTER],
        skipped=skipped,
    )


def fitted_records(meas: Measurements, warn: bool = False) -> Measurements:
    """The records ``fit.build_problem`` fits, in its arrays' order: kernels of GPU families
    with a preset (``placed_kernels``, which ``warn``s), collectives of a named
    cluster that ``COLLECTIVES`` prices, GEMMs of ``FIT_PRECISIONS`` (fp32 is left out: XLA
    runs it on TF32 tensor cores, while the presets' fp32 peak is the vector rate)."""
    meas = placed_kernels(meas, warn=warn)
    colls = [r for r in meas.collectives if r.cluster and r.collective in COLLECTIVES]
    gemms = [g for g in meas.gemms if g.precision in FIT_PRECISIONS]
    return dataclasses.replace(meas, collectives=colls, gemms=gemms)


# --------------------------------------------------------------------------------------------
# CSV helpers


class CsvTable:
    """A CSV file read row by row with line numbers, header checks and typed cells."""

    def __init__(self, path, required: Iterable[str], kind: str):
        self.path = str(path)
        self.kind = kind
        self._fh = open_file(path, newline="", encoding="utf-8-sig")
        self._reader = csv.reader(self._fh)
        try:
            header = next(self._reader, [])
            blank = not any(h.strip() for h in header)
            if blank and not any(any(c.strip() for c in cells) for cells in self._reader):
                self._fh.close()
                raise ReaderError(
                    self.path, None, f"the file is empty (expected a {kind} CSV header)"
                )
        except csv.Error as e:
            self._fh.close()
            raise ReaderError(self.path, 1, f"not a CSV header: {e}") from None
        self.header = [h.strip() for h in header]
        missing = [c for c in required if c not in self.header]
        if missing:
            self._fh.close()
            raise ReaderError(
                self.path, 1, f"missing required {kind} columns: {', '.join(missing)}"
            )

    def rows(self) -> Iterator[tuple[int, dict]]:
        """(first line of the row, {column: stripped cell}) for every non-blank row."""
        try:
            for start, cells in data_rows(self._reader, len(self.header)):
                yield start, {k: v.strip() for k, v in zip(self.header, cells)}
        except CsvLineError as e:
            raise ReaderError(self.path, e.line, e.message) from None
        finally:
            self._fh.close()

    def number(self, row: dict, line: int, col: str, integer: bool = False):
        """The cell as float (or int); None when blank or the column is absent."""
        text = row.get(col, "")
        if not text:
            return None
        if why := number_error(text, integer):
            raise ReaderError(self.path, line, f"column '{col}': {why}")
        return int(float(text)) if integer else float(text)


# --------------------------------------------------------------------------------------------
# Collective names, element types and placement

_COLL_ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "sendrecv": "send_recv",
    "permute": "permute",
    "collectivepermute": "permute",
    "broadcast": "broadcast",
}


def canonical_collective(name: str) -> str:
    key = re.sub(r"[^a-z]", "", name.lower())
    return _COLL_ALIASES.get(key, name.strip().lower())


def check_collectives(collectives) -> tuple[str, ...]:
    wanted = tuple(canonical_collective(c) for c in collectives)
    bad = [c for c in wanted if c not in COLLECTIVES]
    if bad:
        raise ValueError(f"unknown collectives {bad}; known: {', '.join(COLLECTIVES)}")
    return wanted


_DTYPES = {
    "float": "fp32",
    "float32": "fp32",
    "f32": "fp32",
    "fp32": "fp32",
    "half": "fp16",
    "float16": "fp16",
    "f16": "fp16",
    "fp16": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "double": "fp64",
    "float64": "fp64",
    "f64": "fp64",
    "fp64": "fp64",
}


def dtype_name(name: str) -> str:
    low = name.strip().lower()
    if re.fullmatch(r"fp?8(e\d+m\d+\w*)?", low):
        return "fp8"
    return _DTYPES.get(low, low)


def placement(collective: str, n_ranks: int, group_size: int, per_node_max: int):
    """(group_size, per_node, n_nodes, n_groups_factor) of one group.

    ``per_node_max``: ranks of the group that share one node. For send/recv the pair crosses
    nodes as soon as the ring does.
    """
    if collective == "send_recv":
        crosses = per_node_max < group_size
        return 2, (1 if crosses else 2), (2 if crosses else 1)
    per_node = max(1, min(group_size, per_node_max))
    return group_size, per_node, -(-group_size // per_node)
