"""Raw stdout of nccl-tests (``all_reduce_perf``, ``all_gather_perf``, ``reduce_scatter_perf``,
``alltoall_perf``, ``sendrecv_perf``) as collective records.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter

from calibration.records import (
    COLLECTIVES,
    NCCL_TESTS_SOURCE,
    CollectiveRecord,
    Measurements,
    ReaderError,
    Source,
    canonical_collective,
    dtype_name,
    open_file,
    placement,
)
from diffcost.gpus import known_family, preset_gpu

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
MARKERS_RE = re.compile(
    r"#\s*(Collective test starting|Using devices|nThread\s+\d|Avg bus bandwidth)|out-of-place"
)


def _collective_from_filename(path: str) -> str | None:
    m = _FILE_RE.search(os.path.basename(path))
    if not m:
        return None
    return canonical_collective(m.group(1))


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
    with open_file(path, encoding="utf-8", errors="replace") as fh:
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
    size, per_node, nodes = placement(name, n_ranks, group, per_node_max)
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
            dtype=dtype_name(tokens[2]),
            time_s=time_us * 1e-6,
            source_name=NCCL_TESTS_SOURCE,
            where=where,
        )
    )
