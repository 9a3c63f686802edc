"""Reader of nccl-tests output (calibration.readers.read_nccl_tests): fixtures, layouts,
several tables in one file, and the errors a malformed log gets."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from calibration.readers import ReaderError, Source, load, read_nccl_tests

DATA = Path(__file__).parent / "data"
NCCL_AR = DATA / "readers_nccl_all_reduce.txt"
NCCL_AG = DATA / "readers_nccl_all_gather.log"
NCCL_SR = DATA / "readers_nccl_sendrecv_2host.txt"


def line_of(path: Path, text: str) -> int:
    """1-based number of the first line of ``path`` that contains ``text``."""
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if text in line:
            return i
    raise AssertionError(f"{text!r} not in {path}")


def test_nccl_all_reduce():
    m = read_nccl_tests(NCCL_AR, cluster="dgx-h100")
    assert len(m.collectives) == 32 and not m.skipped
    first, last = m.collectives[0], m.collectives[-1]
    assert first.where == Source(str(NCCL_AR), line_of(NCCL_AR, "           8             2"))
    assert (first.collective, first.size_bytes, first.dtype) == ("all_reduce", 8.0, "fp32")
    assert first.time_s == pytest.approx(13.67e-6)  # out-of-place, not the in-place 13.03
    assert last.size_bytes == 17179869184 and last.time_s == pytest.approx(62648e-6)
    assert {(r.group_size, r.per_node, r.n_nodes, r.n_groups) for r in m.collectives} == {
        (8, 8, 1, 1)
    }
    assert {r.cluster for r in m.collectives} == {"dgx-h100"}
    assert {r.source_name for r in m.collectives} == {"nccl-tests"}


def test_nccl_all_gather_old_layout_two_hosts():
    """No redop/root columns; the test named only on the command line; 2 hosts x 4 GPUs."""
    m = read_nccl_tests(NCCL_AG)
    assert len(m.collectives) == 6
    r = m.collectives[0]
    assert (r.collective, r.size_bytes, r.cluster) == ("all_gather", 1048576.0, None)
    assert r.time_s == pytest.approx(143.18e-6)
    assert (r.group_size, r.per_node, r.n_nodes, r.n_groups) == (8, 4, 2, 1)
    # one NVLink domain over both hosts (e.g. an NVL72 rack): the caller says so
    one = read_nccl_tests(NCCL_AG, gpus_per_node=8).collectives[0]
    assert (one.group_size, one.per_node, one.n_nodes) == (8, 8, 1)


def test_nccl_sendrecv_two_hosts():
    """The test named only by the file name; one rank per host: the pair crosses nodes."""
    m = read_nccl_tests(NCCL_SR, cluster="dgx-h100")
    assert len(m.collectives) == 9
    r = m.collectives[-1]
    assert (r.collective, r.dtype, r.size_bytes) == ("send_recv", "bf16", 134217728.0)
    assert r.time_s == pytest.approx(2933.62e-6)
    assert (r.group_size, r.per_node, r.n_nodes, r.n_groups) == (2, 1, 2, 2)


_SPLIT = """\
# Collective test starting: alltoall_perf
# nThread 1 nGpus 4 minBytes 1024 maxBytes 4096 step: 2(factor) warmup iters: 5 iters: 20
#
# Using devices
#  Rank  0 Group  0 Pid   1000 on     node-a device  0 [0x1b] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   1000 on     node-a device  1 [0x2b] NVIDIA H100 80GB HBM3
#  Rank  2 Group  1 Pid   1000 on     node-a device  2 [0x3b] NVIDIA H100 80GB HBM3
#  Rank  3 Group  1 Pid   1000 on     node-a device  3 [0x4b] NVIDIA H100 80GB HBM3
#
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
        1024           128  bfloat16    none      -1    10.10    0.10    0.05      0    10.20    0.10    0.05      0
        2048           256  bfloat16    none      -1    11.00    0.19    0.09      0    11.10    0.18    0.09      0
# Avg bus bandwidth    : 0.07
# Collective test starting: broadcast_perf
# nThread 1 nGpus 4 minBytes 1024 maxBytes 1024 step: 2(factor) warmup iters: 5 iters: 20
#
# Using devices
#  Rank  0 Group  0 Pid   1001 on     node-a device  0 [0x1b] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   1001 on     node-a device  1 [0x2b] NVIDIA H100 80GB HBM3
#
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
        1024           256     float    none       0     8.00    0.13    0.13      0     8.10    0.13    0.13      0
# Avg bus bandwidth    : 0.13
"""


def test_nccl_split_groups_and_several_tables(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text(_SPLIT)
    m = read_nccl_tests(path, cluster="generic-h100")
    assert [(r.collective, r.size_bytes) for r in m.collectives] == [
        ("all_to_all", 1024.0),
        ("all_to_all", 2048.0),
    ]
    r = m.collectives[0]
    assert (r.group_size, r.per_node, r.n_nodes, r.n_groups) == (2, 2, 1, 2)
    assert r.where.line == 12
    assert len(m.skipped) == 1 and m.skipped[0][0].line == 23
    assert "broadcast not read" in m.skipped[0][1]


def test_nccl_undeterminable_test(tmp_path):
    path = tmp_path / "results.txt"
    shutil.copy(NCCL_SR, path)
    header = line_of(path, "#       size")
    with pytest.raises(ReaderError, match="cannot tell which nccl-tests program") as e:
        read_nccl_tests(path)
    assert f"{path}:{header}:" in str(e.value)


@pytest.mark.parametrize(
    "bad",
    [
        "     1048576        262144   float   oops    7.32    6.41  0e+00   141.03    7.44    6.51  0e+00",
        "     1048576        262144   float",
        "  1048576.5        262144   float   143.18    7.32    6.41  0e+00   141.03    7.44    6.51  0e+00",
        "Segmentation fault (core dumped)",
    ],
)
def test_nccl_malformed_line(tmp_path, bad):
    lines = NCCL_AG.read_text().splitlines()
    at = line_of(NCCL_AG, "     4194304")  # replace the second data line
    lines[at - 1] = bad
    path = tmp_path / "all_gather.log"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReaderError, match="malformed nccl-tests data line") as e:
        read_nccl_tests(path)
    assert str(e.value).startswith(f"{path}:{at}: ")
    assert bad.strip() in str(e.value)
    assert e.value.file == str(path) and e.value.line == at


def test_nccl_rank_problems(tmp_path):
    # nccl-tests built without MPI: every process is its own rank 0
    text = NCCL_SR.read_text().replace("Rank  1 Group", "Rank  0 Group")
    path = tmp_path / "sendrecv.txt"
    path.write_text(text)
    with pytest.raises(ReaderError, match="rank 0 listed twice") as e:
        read_nccl_tests(path)
    assert f"{path}:{line_of(path, 'Pid  50562')}:" in str(e.value)
    # no rank lines at all
    path.write_text("\n".join(ln for ln in NCCL_SR.read_text().splitlines() if "Rank" not in ln))
    with pytest.raises(ReaderError, match="no '#  Rank"):
        read_nccl_tests(path)
    path.write_text("# nThread 1 nGpus 1\n# Using devices\n")
    with pytest.raises(ReaderError, match="no nccl-tests result table"):
        read_nccl_tests(path)


def _with_data_line(src: Path, dst: Path, size: str, edit) -> int:
    """Copy ``src`` to ``dst`` with ``edit(tokens)`` applied to the data line of ``size``
    bytes; returns that line's number."""
    lines = src.read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [size])
    tokens = lines[at].split()
    edit(tokens)
    lines[at] = "  ".join(tokens)
    dst.write_text("\n".join(lines) + "\n")
    return at + 1


def test_nccl_wrong_elements_are_skipped(tmp_path):
    """A size where nccl-tests' own check failed (#wrong > 0) is not a measurement to fit;
    N/A (the check turned off) is accepted."""
    path = tmp_path / "all_reduce.txt"
    shutil.copy(NCCL_AR, path)
    # columns: size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong
    out_of_place = _with_data_line(path, path, "1024", lambda t: t.__setitem__(8, "17"))
    in_place = _with_data_line(path, path, "2048", lambda t: t.__setitem__(12, "3"))
    both = _with_data_line(
        path, path, "4096", lambda t: t.__setitem__(8, "1") or t.__setitem__(12, "2")
    )
    unchecked = _with_data_line(
        path, path, "8192", lambda t: t.__setitem__(8, "N/A") or t.__setitem__(12, "N/A")
    )
    m = read_nccl_tests(path, cluster="dgx-h100")
    assert [(s.line, reason) for s, reason in m.skipped] == [
        (out_of_place, "nccl-tests reported 17 wrong elements (out-of-place)"),
        (in_place, "nccl-tests reported 3 wrong elements (in-place)"),
        (
            both,
            "nccl-tests reported 1 wrong elements (out-of-place) and 2 wrong elements (in-place)",
        ),
    ]
    assert len(m.collectives) == 32 - 3
    assert unchecked in {r.where.line for r in m.collectives}
    # older layouts print a maximum "error", not a count: a small float error is no skip
    ag = tmp_path / "all_gather.log"
    _with_data_line(NCCL_AG, ag, "1048576", lambda t: t.__setitem__(6, "2e-07"))
    assert len(read_nccl_tests(ag).collectives) == 6


def test_nccl_gpu_must_match_the_cluster(tmp_path):
    """The rank lines name the GPU; a cluster preset of another GPU family is an error."""
    first_rank = line_of(NCCL_AR, "#  Rank  0")
    with pytest.raises(ReaderError) as e:
        read_nccl_tests(NCCL_AR, cluster="vtrain-a100")
    assert str(e.value) == (
        f"{NCCL_AR}:{first_rank}: the log was measured on NVIDIA H100 80GB HBM3 (h100) but "
        "cluster vtrain-a100 has A100 GPUs (a100); pass the matching --cluster"
    )
    with pytest.raises(ReaderError, match="cluster generic-a100 has A100"):
        load([NCCL_AR], cluster="generic-a100")
    # the same family under another preset, no cluster, or an unknown preset: no check
    assert len(read_nccl_tests(NCCL_AG, cluster="vtrain-a100").collectives) == 6
    assert len(read_nccl_tests(NCCL_AR, cluster="mosaic-h100").collectives) == 32
    assert len(read_nccl_tests(NCCL_AR).collectives) == 32
    assert len(read_nccl_tests(NCCL_AR, cluster="no-such-preset").collectives) == 32
    # a GPU name of no known family is not checked
    path = tmp_path / "all_reduce.txt"
    path.write_text(NCCL_AR.read_text().replace("NVIDIA H100 80GB HBM3", "Accelerator X 96GB"))
    assert len(read_nccl_tests(path, cluster="vtrain-a100").collectives) == 32
