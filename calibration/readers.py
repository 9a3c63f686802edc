"""Read measurement files into typed records for calibration.

Four formats are read (schemas in ``shared/data/README.md``):

* end-to-end runs (CSV with ``measured_iter_s``) -> :class:`E2ERecord`, through the row
  conversion of :mod:`diffcost.runs` (same defaults, same skip reasons);
* collective timings (CSV with ``collective`` and ``time_us``) -> :class:`CollectiveRecord`;
* raw stdout of nccl-tests (``all_reduce_perf``, ``all_gather_perf``, ``reduce_scatter_perf``,
  ``alltoall_perf``, ``sendrecv_perf``) -> :class:`CollectiveRecord`
  (:mod:`calibration.nccl_tests`);
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
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from calibration.nccl_tests import MARKERS_RE, read_nccl_tests
from calibration.records import (
    COLLECTIVES,
    CollectiveRecord,
    CsvTable,
    E2ERecord,
    GemmRecord,
    Measurements,
    ReaderError,
    Source,
    canonical_collective,
    check_collectives,
    dtype_name,
    open_file,
    placement,
)
from diffcost.gpus import family_peak_flops, gpu_family
from diffcost.runs import (
    E2E_COLUMNS,
    E2E_FLOAT_COLUMNS,
    E2E_INT_COLUMNS,
    RowSkipped,
    row_to_specs,
    stack_name,
)

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
    table = CsvTable(path, E2E_REQUIRED, "end-to-end")
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
        stack = stack_name(row.get("framework", ""))
        record = E2ERecord(
            model, plan, cluster, measured, row["source"], row_no, tuple(used), where, stack
        )
        out.e2e.append(record)
    return out


# --------------------------------------------------------------------------------------------
# Collectives CSV

COLLECTIVES_REQUIRED = ("source", "collective", "size_bytes", "n_gpus", "time_us")


def read_collectives_csv(path, collectives=COLLECTIVES) -> Measurements:
    """Collective timings of a CSV in the schema of ``shared/data/README.md`` section 2.

    Rows of collectives not in ``collectives`` (``permute``, ``broadcast``, ...) are skipped with
    the reason. Blank ``group_size``/``n_groups`` mean one group of all ``n_gpus`` (send/recv:
    ``sendrecv_perf``'s ring, see the module docstring). Blank ``gpus_per_node`` is
    ``n_gpus / n_nodes``; blank ``n_nodes`` is ``ceil(n_gpus / gpus_per_node)``.
    """
    wanted = check_collectives(collectives)
    table = CsvTable(path, COLLECTIVES_REQUIRED, "collectives")
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
        name = canonical_collective(row["collective"])

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
            group_size, per_node, nodes = placement(name, n_gpus, n_gpus, gpn)
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
            group_size, per_node, nodes = placement(name, n_gpus, group, gpn)
        out.collectives.append(
            CollectiveRecord(
                collective=name,
                size_bytes=size,
                group_size=group_size,
                per_node=per_node,
                n_nodes=nodes,
                n_groups=n_groups,
                cluster=row.get("cluster") or None,
                dtype=dtype_name(row.get("dtype", "")) or "unknown",
                time_s=time_us * 1e-6,
                source_name=row["source"],
                where=where,
            )
        )
    return out


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
    table = CsvTable(path, GEMM_REQUIRED, "GEMM")
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
    with open_file(path, encoding="utf-8-sig", errors="replace") as fh:
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
    if MARKERS_RE.search(text):
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
