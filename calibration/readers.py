"""Read measurement files into typed records for calibration.

Four formats are read (schemas in ``shared/data/README.md``):

* end-to-end runs (CSV with ``measured_iter_s``) -> :class:`E2ERecord`, through the row
  conversion of :mod:`diffcost.validate` (same defaults, same skip reasons);
* collective timings (CSV with ``collective`` and ``time_us``) -> :class:`CollectiveRecord`;
* raw stdout of nccl-tests (``all_reduce_perf``, ``all_gather_perf``, ``reduce_scatter_perf``,
  ``alltoall_perf``, ``sendrecv_perf``) -> :class:`CollectiveRecord`;
* GEMM throughput (CSV with ``flops_per_s`` and ``m``, ``n``, ``k``) -> :class:`GemmRecord`.

All values are SI (seconds, bytes). Every record keeps the file and 1-based line it came from
(the CSV header is line 1). Rows that cannot be represented are listed in
``Measurements.skipped`` with the reason; malformed input raises :class:`ReaderError`, whose
message starts with ``file:line:``.

Collective placement fields (what :func:`diffcost.comm.place` needs):

* ``group_size``: ranks of one communicator; ``n_groups``: communicators running at once.
* ``per_node``: ranks of one group inside one node (NVLink domain); ``n_nodes``: nodes one
  group spans (``ceil(group_size / per_node)``). Groups are taken as contiguous in rank order.
* ``send_recv`` is one sender and one receiver: ``group_size = 2``; nccl-tests' ``sendrecv_perf``
  sends from every rank to the next one in a ring, so ``n_groups`` is the number of ranks (that
  many transfers run at once) and, when the ranks span several nodes, the slowest pair crosses
  nodes: ``per_node = 1``, ``n_nodes = 2``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from diffcost.gpus import family_peak_flops, gpu_family, known_family, preset_family, preset_gpu
from diffcost.runs import (
    E2E_COLUMNS,
    E2E_FLOAT_COLUMNS,
    E2E_INT_COLUMNS,
    CsvLineError,
    RowSkipped,
    data_rows,
    number_error,
    row_to_specs,
)
from diffcost.specs import ClusterSpec, ModelSpec, PlanSpec

__all__ = [
    "COLLECTIVES",
    "CollectiveRecord",
    "E2ERecord",
    "GemmRecord",
    "Measurements",
    "ReaderError",
    "Source",
    "load",
    "read_collectives_csv",
    "read_e2e_csv",
    "read_gemm_csv",
    "read_nccl_tests",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
NCCL_TESTS_SOURCE = "nccl-tests"


class ReaderError(ValueError):
    """Malformed input; the message starts with ``file:line:``."""

    def __init__(self, file, line: int | None, message: str):
        self.file = str(file)
        self.line = line
        where = f"{self.file}:{line}" if line is not None else self.file
        super().__init__(f"{where}: {message}")


def _open(path, **kwargs):
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
    skipped: list[tuple[Source, str]] = dataclasses.field(default_factory=list)

    def __add__(self, other: Measurements) -> Measurements:
        if not isinstance(other, Measurements):
            return NotImplemented
        return Measurements(
            e2e=self.e2e + other.e2e,
            collectives=self.collectives + other.collectives,
            gemms=self.gemms + other.gemms,
            skipped=self.skipped + other.skipped,
        )

    def __radd__(self, other):  # sum([...]) starts from 0
        if other == 0:
            return self
        return NotImplemented

    def __len__(self) -> int:
        return len(self.e2e) + len(self.collectives) + len(self.gemms)

    def filter(self, cluster=None, gpu=None, sources=None) -> Measurements:
        """The records matching every given criterion (each a name or an iterable of names).

        * ``cluster``: preset names. E2E and collective records by their cluster; GEMM records
          by the GPU family of those presets (GEMMs carry no cluster).
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

        def keep_gemm(r: GemmRecord) -> bool:
            return (
                (cluster_gpus is None or r.gpu in cluster_gpus)
                and (gpus is None or r.gpu in gpus)
                and (srcs is None or r.source_name in srcs)
            )

        return Measurements(
            e2e=[r for r in self.e2e if keep_e2e(r)],
            collectives=[r for r in self.collectives if keep_coll(r)],
            gemms=[r for r in self.gemms if keep_gemm(r)],
            skipped=list(self.skipped),
        )

    def counts(self) -> dict:
        """Record counts per kind and skip counts per reason."""
        return {
            "e2e": len(self.e2e),
            "collectives": len(self.collectives),
            "gemms": len(self.gemms),
            "skipped": dict(Counter(reason for _, reason in self.skipped).most_common()),
        }


# --------------------------------------------------------------------------------------------
# CSV helpers


class _Csv:
    """A CSV file read row by row with line numbers, header checks and typed cells."""

    def __init__(self, path, required: Iterable[str], kind: str):
        self.path = str(path)
        self.kind = kind
        self._fh = _open(path, newline="", encoding="utf-8-sig")
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
# End-to-end runs

# The same columns as diffcost.validate (``diffcost validate`` and calibration agree on which
# files they accept).
E2E_REQUIRED = E2E_COLUMNS
_E2E_INT = E2E_INT_COLUMNS
_E2E_FLOAT = E2E_FLOAT_COLUMNS


def read_e2e_csv(path) -> Measurements:
    """End-to-end runs of a CSV in the schema of ``shared/data/README.md`` section 1.

    Rows become specs through ``diffcost.runs.row_to_specs`` (framework defaults for
    blank cells, listed in ``E2ERecord.defaults``); rows it cannot represent, and rows without
    a positive ``measured_iter_s``, are in ``skipped``.
    """
    table = _Csv(path, E2E_REQUIRED, "end-to-end")
    out = Measurements()
    cluster_cache: dict = {}
    for row_no, (line, row) in enumerate(table.rows(), start=1):
        where = Source(table.path, line)
        for col in _E2E_INT:
            table.number(row, line, col, integer=True)
        for col in _E2E_FLOAT:
            table.number(row, line, col)
        measured = table.number(row, line, "measured_iter_s")
        if measured is None:
            out.skipped.append((where, "measured_iter_s blank"))
            continue
        if measured <= 0:
            text = str(row["measured_iter_s"]).strip()
            out.skipped.append((where, f"measured_iter_s {text} is not a positive time"))
            continue
        try:
            model, plan, cluster, used = row_to_specs(row, cluster_cache)
        except RowSkipped as e:
            out.skipped.append((where, str(e)))
            continue
        out.e2e.append(
            E2ERecord(
                model=model,
                plan=plan,
                cluster=cluster,
                measured_iter_s=measured,
                source_name=row["source"],
                row=row_no,
                defaults=tuple(used),
                where=where,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Collectives CSV

COLLECTIVES_REQUIRED = ("source", "collective", "size_bytes", "n_gpus", "time_us")
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


def _canonical_collective(name: str) -> str:
    key = re.sub(r"[^a-z]", "", name.lower())
    return _COLL_ALIASES.get(key, name.strip().lower())


def _check_collectives(collectives) -> tuple[str, ...]:
    wanted = tuple(_canonical_collective(c) for c in collectives)
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


def _dtype(name: str) -> str:
    low = name.strip().lower()
    if re.fullmatch(r"fp?8(e\d+m\d+\w*)?", low):
        return "fp8"
    return _DTYPES.get(low, low)


def _placement(collective: str, n_ranks: int, group_size: int, per_node_max: int):
    """(group_size, per_node, n_nodes, n_groups_factor) of one group.

    ``per_node_max``: ranks of the group that share one node. For send/recv the pair crosses
    nodes as soon as the ring does.
    """
    if collective == "send_recv":
        crosses = per_node_max < group_size
        return 2, (1 if crosses else 2), (2 if crosses else 1)
    per_node = max(1, min(group_size, per_node_max))
    return group_size, per_node, -(-group_size // per_node)


def read_collectives_csv(path, collectives=COLLECTIVES) -> Measurements:
    """Collective timings of a CSV in the schema of ``shared/data/README.md`` section 2.

    Rows of collectives not in ``collectives`` (``permute``, ``broadcast``, ...) are skipped with
    the reason. Blank ``group_size``/``n_groups`` mean one group of all ``n_gpus`` (send/recv:
    ``sendrecv_perf``'s ring, see the module docstring). Blank ``gpus_per_node`` is
    ``n_gpus / n_nodes``; blank ``n_nodes`` is ``ceil(n_gpus / gpus_per_node)``.
    """
    wanted = _check_collectives(collectives)
    table = _Csv(path, COLLECTIVES_REQUIRED, "collectives")
    out = Measurements()
    for line, row in table.rows():
        where = Source(table.path, line)
        num = lambda col, integer=True: table.number(row, line, col, integer)
        size = num("size_bytes", False)
        n_gpus = num("n_gpus")
        n_nodes = num("n_nodes")
        gpn = num("gpus_per_node")
        group = num("group_size")
        n_groups = num("n_groups")
        time_us = num("time_us", False)
        for col in ("algbw_GBps", "busbw_GBps"):
            num(col, False)
        name = _canonical_collective(row["collective"])

        def skip(reason: str):
            out.skipped.append((where, reason))

        if name not in wanted:
            skip(f"collective '{row['collective']}' not read (reading: {', '.join(wanted)})")
            continue
        given = {"size_bytes": size, "time_us": time_us, "n_gpus": n_gpus}
        if None in given.values():
            skip(f"blank {', '.join(c for c, v in given.items() if v is None)}")
            continue
        if size <= 0 or time_us <= 0 or n_gpus < 1:
            skip("size_bytes, time_us and n_gpus must be positive")
            continue
        if gpn is None and n_nodes:
            gpn = n_gpus // n_nodes if n_gpus % n_nodes == 0 else None
        if gpn is None or gpn < 1:
            skip("gpus_per_node blank and not derivable from n_gpus / n_nodes")
            continue
        if n_nodes is not None and n_nodes * gpn != n_gpus:
            skip(f"n_nodes * gpus_per_node = {n_nodes * gpn} differs from n_gpus = {n_gpus}")
            continue
        if name == "send_recv":
            pairs = n_groups if group == 2 and n_groups else n_gpus
            group_size, per_node, nodes = _placement(name, n_gpus, n_gpus, gpn)
            n_groups = pairs
        else:
            if group is None and n_groups is None:
                group, n_groups = n_gpus, 1
            elif group is None or n_groups is None:
                group = group if group is not None else n_gpus // n_groups
                n_groups = n_groups if n_groups is not None else n_gpus // group
            if group < 1 or group * n_groups != n_gpus:
                skip(f"group_size * n_groups = {group * n_groups} differs from n_gpus = {n_gpus}")
                continue
            group_size, per_node, nodes = _placement(name, n_gpus, group, gpn)
        out.collectives.append(
            CollectiveRecord(
                collective=name,
                size_bytes=size,
                group_size=group_size,
                per_node=per_node,
                n_nodes=nodes,
                n_groups=n_groups,
                cluster=row.get("cluster") or None,
                dtype=_dtype(row.get("dtype", "")) or "unknown",
                time_s=time_us * 1e-6,
                source_name=row["source"],
                where=where,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# nccl-tests output

_TEST_NAMES = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "sendrecv": "send_recv",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "hypercube": "hypercube",
}
_PERF_RE = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(_TEST_NAMES) + r")_perf(?![A-Za-z0-9])")
_FILE_RE = re.compile(
    r"(all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|send_?recv)", re.IGNORECASE
)
_RANK_RE = re.compile(
    r"^#\s*Rank\s+(\d+)\s+(?:Group\s+(\d+)\s+)?Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)"
    r"(?:\s+\[[^\]]*\])?\s*(.*)$"  # then the bus id and the GPU name
)
_LOG_RE = re.compile(r"NCCL (INFO|WARN)|^NCCL version")
_MARKERS_RE = re.compile(
    r"#\s*(Collective test starting|Using devices|nThread\s+\d|Avg bus bandwidth)|out-of-place"
)


def _collective_from_filename(path: str) -> str | None:
    m = _FILE_RE.search(os.path.basename(path))
    if not m:
        return None
    return _canonical_collective(m.group(1))


def read_nccl_tests(path, cluster: str | None = None, gpus_per_node: int | None = None):
    """Collective timings from the stdout of nccl-tests (one or several result tables).

    The test of each table comes from the last ``..._perf`` named before it (the
    ``# Collective test starting:`` line or the command line), else from the file name; the
    GPU count, groups (``Group`` = the split colour) and hosts from the ``#  Rank ...`` lines.
    The out-of-place time is used. ``gpus_per_node`` overrides the hosts: give it where one
    NVLink domain spans several hosts (NVL72: 72). ``cluster`` is stored on every record.
    Data lines where nccl-tests' own check found wrong elements (``#wrong`` > 0, out-of-place
    or in-place) are skipped with the count; ``N/A`` (check disabled) is accepted.

    Raises:
        ReaderError: a missing or empty file, no result table, unknown test, missing or
            contradictory rank lines, a rank's GPU of another family than the GPU of
            ``cluster``'s preset, or a malformed data line (file, line and text in the
            message). GPU names of no known family (see :func:`gpu_family`) are not checked.
    """
    path = str(path)
    wanted = COLLECTIVES
    out = Measurements()
    with _open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().splitlines()
    if not any(line.strip() for line in lines):
        raise ReaderError(path, None, "the file is empty")
    cluster_gpu = preset_gpu(cluster) if isinstance(cluster, str) else None
    cluster_family = None if cluster_gpu is None else known_family(cluster_gpu)

    test: str | None = None  # from the last "..._perf" mention
    ranks: dict[int, tuple[int, str, str]] = {}  # rank -> (group, host, pid)
    ranks_line = None
    table = None  # dict while inside a result table
    tables = 0
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        if text.startswith("#"):
            body = text[1:].strip()
            m = _PERF_RE.search(text)
            if m:
                test = _TEST_NAMES[m.group(1)]
            if body.startswith("Using devices"):
                ranks, ranks_line, table = {}, lineno, None
                continue
            rm = _RANK_RE.match(text)
            if rm:
                rank, group = int(rm.group(1)), int(rm.group(2) or 0)
                info = (group, rm.group(4), rm.group(3))
                if rank in ranks and ranks[rank] != info:
                    raise ReaderError(
                        path,
                        lineno,
                        f"rank {rank} listed twice with different process or host "
                        "(nccl-tests built without MPI, each process its own job?): "
                        f"{text!r}",
                    )
                ranks[rank] = info
                log_gpu = rm.group(6).strip()
                log_family = known_family(log_gpu)
                if cluster_family and log_family and log_family != cluster_family:
                    raise ReaderError(
                        path,
                        lineno,
                        f"the log was measured on {log_gpu} ({log_family}) but cluster "
                        f"{cluster} has {cluster_gpu} GPUs ({cluster_family}); pass the "
                        "matching --cluster",
                    )
                continue
            tokens = body.split()
            if tokens[:2] == ["size", "count"] and "time" in tokens:
                table = _start_table(path, lineno, tokens, test, ranks, ranks_line, gpus_per_node)
                tables += 1
                continue
            if body.startswith("Avg bus bandwidth"):
                table = None
            continue
        if table is None:
            m = _PERF_RE.search(text)  # a command line outside a table names the test
            if m:
                test = _TEST_NAMES[m.group(1)]
            continue
        if _LOG_RE.search(text):
            continue
        _data_line(path, lineno, text, table, wanted, cluster, out)
    if not tables:
        raise ReaderError(
            path, None, "no nccl-tests result table (a '#  size  count  type ...' header) found"
        )
    return out


def _start_table(path, lineno, tokens, test, ranks, ranks_line, gpus_per_node) -> dict:
    name = test or _collective_from_filename(path)
    if name is None:
        raise ReaderError(
            path,
            lineno,
            "cannot tell which nccl-tests program wrote this table: no '..._perf' name "
            'before it ("# Collective test starting: all_reduce_perf" or the command line) '
            "and none in the file name",
        )
    if not ranks:
        raise ReaderError(
            path, lineno, "no '#  Rank N Group G Pid P on HOST device D' lines before the table"
        )
    n_ranks = len(ranks)
    if sorted(ranks) != list(range(n_ranks)):
        raise ReaderError(
            path, ranks_line, f"rank lines list ranks {sorted(ranks)}, not 0..{n_ranks - 1}"
        )
    groups: dict[int, list[str]] = {}
    for g, host, _pid in ranks.values():
        groups.setdefault(g, []).append(host)
    sizes = {len(h) for h in groups.values()}
    if len(sizes) != 1:
        raise ReaderError(path, ranks_line, f"groups of unequal size {sorted(sizes)}")
    group = sizes.pop()
    if gpus_per_node is not None:
        per_node_max = min(group, int(gpus_per_node))
    else:
        per_node_max = min(max(Counter(h).values()) for h in groups.values())
    size, per_node, nodes = _placement(name, n_ranks, group, per_node_max)
    return {
        "collective": name,
        "lead": tokens.index("time"),
        "group_size": size,
        "per_node": per_node,
        "n_nodes": nodes,
        "n_groups": n_ranks if name == "send_recv" else len(groups),
        # nccl-tests' correctness counts: the out-of-place one, then the in-place one (older
        # layouts print an "error" column, a maximum error rather than a count: not checked)
        "wrong": [i for i, t in enumerate(tokens) if t == "#wrong"][:2],
    }


def _data_line(path, lineno, text, table, wanted, cluster, out: Measurements) -> None:
    tokens = text.split()
    lead = table["lead"]

    def bad(why: str):
        raise ReaderError(path, lineno, f"malformed nccl-tests data line ({why}): {text!r}")

    if len(tokens) < lead + 4:
        bad(f"{len(tokens)} fields, expected at least {lead + 4}")
    try:
        size, count = int(tokens[0]), int(tokens[1])
    except ValueError:
        bad("size and count must be integers")
    try:
        time_us, algbw, busbw = (float(t) for t in tokens[lead : lead + 3])
    except ValueError:
        bad("time, algbw and busbw must be numbers")
    if not all(math.isfinite(v) for v in (time_us, algbw, busbw)) or size < 0 or count < 0:
        bad("negative or non-finite value")
    where = Source(path, lineno)
    name = table["collective"]
    if name not in wanted:
        out.skipped.append((where, f"nccl-tests {name} not read (reading: {', '.join(wanted)})"))
        return
    wrong = []
    for i, label in zip(table["wrong"], ("out-of-place", "in-place")):
        cell = tokens[i] if i < len(tokens) else "N/A"
        try:
            n_wrong = float(cell)
        except ValueError:
            continue  # "N/A": nccl-tests ran without its check (-c 0)
        if n_wrong > 0:
            count = int(n_wrong) if n_wrong.is_integer() else n_wrong
            wrong.append(f"{count} wrong elements ({label})")
    if wrong:
        out.skipped.append((where, f"nccl-tests reported {' and '.join(wrong)}"))
        return
    if size == 0 or time_us <= 0:
        out.skipped.append((where, "zero size or time"))
        return
    out.collectives.append(
        CollectiveRecord(
            collective=name,
            size_bytes=float(size),
            group_size=table["group_size"],
            per_node=table["per_node"],
            n_nodes=table["n_nodes"],
            n_groups=table["n_groups"],
            cluster=cluster,
            dtype=_dtype(tokens[2]),
            time_s=time_us * 1e-6,
            source_name=NCCL_TESTS_SOURCE,
            where=where,
        )
    )


# --------------------------------------------------------------------------------------------
# GEMM CSV

GEMM_REQUIRED = ("gpu", "m", "n", "k", "dtype", "flops_per_s")
_GEMM_ELEM = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "f16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "float16": "fp16",
    "f32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
    "float32": "fp32",
}


def _gemm_elem(name: str) -> str | None:
    low = name.strip().lower()
    if re.fullmatch(r"fp?8(e\d+m\d+\w*)?", low):
        return "fp8"
    return _GEMM_ELEM.get(low)


def _gemm_precision(dtype: str) -> tuple[str | None, str]:
    """(precision, "") or (None, reason) for a ``lhs x rhs -> out`` type string."""
    text = dtype.strip().lower().replace(" ", "")
    ins, _, out_t = text.partition("->")
    parts = ins.split("x") if "x" in ins else [ins]
    if len(parts) not in (1, 2) or not all(parts):
        return None, f"dtype '{dtype}' not understood"
    fams = [_gemm_elem(p) for p in parts]
    if None in fams:
        return None, f"dtype '{dtype}': unknown element type"
    if len(set(fams)) != 1:
        return None, f"dtype '{dtype}': inputs of different precisions"
    prec = fams[0]
    out_fam = _gemm_elem(out_t) if out_t else prec
    if prec == "fp8":
        if out_fam not in ("bf16", "fp32"):
            return None, f"fp8 GEMM with {out_t or 'unstated'} output (only bf16/f32 outputs kept)"
    elif out_fam not in ("bf16", "fp16", "fp32"):
        return None, f"dtype '{dtype}': output type not mapped"
    return prec, ""


def read_gemm_csv(path) -> Measurements:
    """GEMM timings of a CSV in the schema of ``shared/data/README.md`` section 3.

    ``time_s = 2*batch*m*n*k / flops_per_s`` (``time_us`` where ``flops_per_s`` is blank).
    FP8 inputs (e4m3 and e5m2, in any mix) give precision ``"fp8"``; FP8 rows are kept only
    with bf16 or f32 output. Unmappable type combinations are skipped with the reason, and so
    are rows faster than the GPU family's dense datasheet peak at that precision (the XLA H100
    table has 87 FP8 rows up to 2,620 TFLOP/s against a 1,979 peak: whatever ran, it was not
    what the row says). Such a row discredits its whole table (GPU and element types): the
    rows below the peak are the same measurement cut at the peak, and keeping them would pull
    the efficiency up (on the largest shapes the H100 FP8 tables run a median 2.7x faster than
    the bf16 table, where the peaks allow 2x).
    """
    table = _Csv(path, GEMM_REQUIRED, "GEMM")
    out = Measurements()
    kept: list[GemmRecord] = []
    over: Counter = Counter()
    for line, row in table.rows():
        where = Source(table.path, line)
        num = lambda col, integer=True: table.number(row, line, col, integer)
        batch = num("batch")
        m, n, k = num("m"), num("n"), num("k")
        flops = num("flops_per_s", False)
        time_us = num("time_us", False)
        num("tflops", False)
        batch = 1 if batch is None else batch
        if None in (m, n, k):
            out.skipped.append((where, "blank m, n or k"))
            continue
        if min(batch, m, n, k) < 1:
            out.skipped.append((where, "batch, m, n and k must be positive"))
            continue
        prec, reason = _gemm_precision(row["dtype"])
        if prec is None:
            out.skipped.append((where, reason))
            continue
        if flops is not None and flops > 0:
            time_s = 2.0 * batch * m * n * k / flops
        elif flops is None and time_us is not None and time_us > 0:
            time_s = time_us * 1e-6
        else:
            out.skipped.append((where, "no positive flops_per_s or time_us"))
            continue
        family = gpu_family(row["gpu"])
        peak = family_peak_flops(family, prec)
        rate = 2.0 * batch * m * n * k / time_s
        # fp32 is left alone: XLA runs it on TF32 tensor cores, above the presets' vector peak
        if prec != "fp32" and peak is not None and rate > peak:
            over[(family, row["dtype"])] += 1
            out.skipped.append(
                (where, f"{prec} GEMM faster than the {family} dense peak: not a dense GEMM")
            )
            continue
        kept.append(
            GemmRecord(
                gpu=family,
                batch=batch,
                m=m,
                n=n,
                k=k,
                precision=prec,
                time_s=time_s,
                where=where,
                dtype=row["dtype"],
                source_name=row.get("source", ""),
            )
        )
    # A table (GPU, element types) with rows beyond the datasheet peak is not what it says: its
    # rows below the peak come from the same mismeasurement, cut at the peak, so all of them go.
    for g in kept:
        bad = over[(g.gpu, g.dtype)]
        if bad:
            out.skipped.append(
                (g.where, f"{g.dtype} table of {g.gpu} has {bad} row(s) past the dense peak")
            )
        else:
            out.gemms.append(g)
    return out


# --------------------------------------------------------------------------------------------
# Dispatch

ACCEPTED_FORMATS = (
    "end-to-end CSV (header with 'measured_iter_s'), collectives CSV (header with "
    "'collective' and 'time_us'), GEMM CSV (header with 'flops_per_s', 'm', 'n', 'k'), "
    "or nccl-tests stdout (all_reduce_perf, all_gather_perf, reduce_scatter_perf, "
    "alltoall_perf, sendrecv_perf)"
)
_SUFFIXES = (".csv", ".txt", ".log")


def detect_kind(path) -> str:
    """``"e2e"``, ``"collectives"``, ``"gemm"`` or ``"nccl-tests"``; ReaderError otherwise."""
    path = str(path)
    with _open(path, encoding="utf-8-sig", errors="replace") as fh:
        text = fh.read()
    if not text.strip():
        raise ReaderError(path, None, "the file is empty")
    first = text.splitlines()[0]
    try:
        cols = {c.strip() for c in next(csv.reader([first]))} if first else set()
    except csv.Error:
        cols = set()
    if "measured_iter_s" in cols:
        return "e2e"
    if {"collective", "time_us"} <= cols:
        return "collectives"
    if {"flops_per_s", "m", "n", "k"} <= cols:
        return "gemm"
    if _MARKERS_RE.search(text):
        return "nccl-tests"
    raise ReaderError(path, 1, f"unknown file format; accepted: {ACCEPTED_FORMATS}")


def _expand(paths) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in _SUFFIXES)
            if not found:
                raise ReaderError(p, None, "directory holds no *.csv, *.txt or *.log files")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise ReaderError(p, None, "no such file or directory")
    return files


def load(paths: Iterable[str | os.PathLike], cluster=None) -> Measurements:
    """Read every file, detecting each one's format.

    Args:
        paths: files and directories (a directory gives its ``*.csv``, ``*.txt`` and ``*.log``
            files, not recursively); a single path is accepted too.
        cluster: preset name stored on nccl-tests records (their output names none); a list
            of one name is accepted. CSV files carry their own ``cluster`` column.

    Raises:
        ReaderError: a missing path (before any file is read), an empty file, a file of no
            accepted format, malformed content, nccl-tests output with several names given as
            ``cluster`` or measured on GPUs of another family than ``cluster``'s.
    """
    if cluster is not None and not isinstance(cluster, str):
        names = list(cluster)
        cluster = names[0] if len(names) == 1 else (None if not names else names)
    total = Measurements()
    for f in _expand(paths):
        kind = detect_kind(f)
        if kind == "e2e":
            total = total + read_e2e_csv(f)
        elif kind == "collectives":
            total = total + read_collectives_csv(f)
        elif kind == "gemm":
            total = total + read_gemm_csv(f)
        else:
            if isinstance(cluster, list):
                raise ReaderError(
                    f, None, f"nccl-tests output names no cluster; give one, not {cluster}"
                )
            total = total + read_nccl_tests(f, cluster=cluster)
    return total
