"""Readers of measurement files (calibration.readers): fixtures, errors, and the shared data."""

from __future__ import annotations

import csv
import shutil
from collections import Counter
from pathlib import Path

import pytest
from helpers import SHARED_DATA

from calibration.readers import (
    CollectiveRecord,
    GemmRecord,
    Measurements,
    ReaderError,
    Source,
    detect_kind,
    load,
    read_collectives_csv,
    read_e2e_csv,
    read_gemm_csv,
    read_nccl_tests,
)
from diffcost.gpus import gpu_family
from diffcost.runs import E2E_COLUMNS, read_rows

DATA = Path(__file__).parent / "data"
E2E = DATA / "readers_e2e.csv"
COLL = DATA / "readers_collectives.csv"
GEMM = DATA / "readers_gemm.csv"
NCCL_AR = DATA / "readers_nccl_all_reduce.txt"
NCCL_AG = DATA / "readers_nccl_all_gather.log"
NCCL_SR = DATA / "readers_nccl_sendrecv_2host.txt"
SHARED = SHARED_DATA


# ---------------------------------------------------------------------------------------------
# End-to-end CSV


def test_e2e_fixture():
    m = read_e2e_csv(E2E)
    assert [r.source_name for r in m.e2e] == [
        "vtrain_ground_truth_single",
        "mosaicml_llmfoundry_benchmarks",
        "nemo_perf_summary_24.07",
    ]
    first = m.e2e[0]
    assert first.where == Source(str(E2E), 2) and first.row == 1
    assert first.cluster.name == "vtrain-a100"
    assert first.model.n_layers == 24 and first.model.hidden == 1024
    assert (first.plan.tp, first.plan.pp, first.plan.dp) == (1, 2, 1)
    assert first.measured_iter_s == pytest.approx(0.372160408)
    assert "vocab=50257" in first.defaults
    assert isinstance(first.defaults, tuple)
    assert m.e2e[1].model.n_layers == 80 and m.e2e[1].plan.zero == 3
    # attention kernel by framework: Megatron-DeepSpeed, llm-foundry, NeMo
    assert [r.model.attention for r in m.e2e] == ["unfused", "triton", "cudnn"]
    assert [(s.line, reason.split(":")[0]) for s, reason in m.skipped] == [
        (5, "no cluster preset 'no-such-cluster'"),
        (6, "architecture not given by the source"),
        (7, "measured_iter_s blank"),
    ]


def test_e2e_non_positive_time_is_skipped_with_its_value(tmp_path):
    with open(E2E, newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    rows[0]["measured_iter_s"] = "-0.5"
    path = tmp_path / "neg.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, header)
        w.writeheader()
        w.writerows(rows)
    m = read_e2e_csv(path)
    assert (Source(str(path), 2), "measured_iter_s -0.5 is not a positive time") in m.skipped
    assert all(r.where.line != 2 for r in m.e2e)


def test_e2e_family_defaults_for_blank_cells(tmp_path):
    """Blank vocab: the family's tokenizer (Nemotron 256k, Llama 3 128k, else GPT-2's); blank
    recompute: what the framework's configs for that family use."""
    with open(E2E, newline="") as f:
        rows = list(csv.DictReader(f))
    nemo = next(r for r in rows if r["source"].startswith("nemo"))
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for name in ("Nemotron-22B", "LLAMA3-8B", "GPT3-20B"):
            w.writerow({**nemo, "model": name, "vocab": ""})
    got = {r.model.name: r.model for r in read_e2e_csv(path).e2e}
    assert {k: m.vocab for k, m in got.items()} == {
        "Nemotron-22B": 256000,
        "LLAMA3-8B": 128256,
        "GPT3-20B": 50257,
    }
    # Nemotron and Llama: separate output matrix, no biases; GPT-3: tied, biases
    assert [(m.tied_embeddings, m.bias) for m in got.values()] == [
        (False, False),
        (False, False),
        (True, True),
    ]
    # NeMo's GPT-3 configs recompute the attention core; its other models recompute nothing
    plans = {r.model.name: r.plan for r in read_e2e_csv(path).e2e}
    assert {k: p.recompute for k, p in plans.items()} == {
        "Nemotron-22B": "none",
        "LLAMA3-8B": "none",
        "GPT3-20B": "selective",
    }


# ---------------------------------------------------------------------------------------------
# Collectives CSV


def test_collectives_fixture():
    m = read_collectives_csv(COLL)
    by_source = {r.source_name: r for r in m.collectives}
    assert len(m.collectives) == 5
    vt = by_source["vtrain_allreduce_lut"]
    assert vt == CollectiveRecord(
        collective="all_reduce",
        size_bytes=1048576.0,
        group_size=4,
        per_node=4,
        n_nodes=1,
        n_groups=1,
        cluster="vtrain-a100",
        dtype="fp32",
        time_s=pytest.approx(51.4e-6),
        source_name="vtrain_allreduce_lut",
        where=Source(str(COLL), 2),
    )
    gcp = by_source["gcp_a3mega_ztan_nccl"]
    assert (gcp.group_size, gcp.per_node, gcp.n_nodes, gcp.n_groups) == (16, 8, 2, 1)
    ag, rs = (r for r in m.collectives if r.source_name == "xla_collective_perf_table")
    # eight groups of 8 inside one 64-GPU NVLink domain: each group sits in the one "node"
    assert (ag.collective, ag.group_size, ag.per_node, ag.n_nodes, ag.n_groups) == (
        "all_gather",
        8,
        8,
        1,
        8,
    )
    assert ag.cluster == "generic-gb200-nvl72"
    assert (rs.collective, rs.dtype, rs.group_size, rs.n_groups) == ("reduce_scatter", "bf16", 4, 2)
    # sendrecv_perf on 8 GPUs of one node: a ring of 8 one-way transfers, each inside the node
    sr = by_source["liplus_playground_nccl"]
    assert (sr.collective, sr.group_size, sr.per_node, sr.n_nodes, sr.n_groups) == (
        "send_recv",
        2,
        2,
        1,
        8,
    )
    reasons = {s.line: r for s, r in m.skipped}
    assert set(reasons) == {5, 8}
    assert reasons[5].startswith("collective 'permute' not read")
    assert reasons[8] == "blank time_us"


def test_collectives_selection():
    m = read_collectives_csv(COLL, collectives=("all_reduce",))
    assert {r.collective for r in m.collectives} == {"all_reduce"}
    assert len(m.collectives) == 2 and len(m.skipped) == 5
    with pytest.raises(ValueError, match="unknown collectives"):
        read_collectives_csv(COLL, collectives=("permute",))


# ---------------------------------------------------------------------------------------------
# GEMM CSV


def test_gemm_fixture():
    m = read_gemm_csv(GEMM)
    got = [(g.gpu, g.precision, g.dtype) for g in m.gemms]
    assert got == [
        ("h100", "bf16", "bf16xbf16->bf16"),
        ("b200", "fp32", "f32xf32->f32"),
        ("h100", "fp8", "f8e4m3fnxf8e5m2->bf16"),
        ("mi350", "bf16", "bf16xbf16->f32"),
        ("mi350", "fp16", "f16xf16->f16"),
        ("mi350", "fp8", "f8e5m2xf8e4m3fn->f32"),
    ]
    g = m.gemms[0]
    assert (g.batch, g.m, g.n, g.k) == (2, 1024, 256, 256)
    assert g.time_s == pytest.approx(2 * 2 * 1024 * 256 * 256 / 45221606469002)
    assert g.time_s == pytest.approx(5.936e-6, rel=1e-3)  # the CSV's rounded time_us
    assert g.where == Source(str(GEMM), 2) and g.source_name == "xla_default_matmul_perf_table"
    reasons = [(s.line, r) for s, r in m.skipped]
    assert reasons[0][0] == 8 and "fp8 GEMM with f8e4m3fn output" in reasons[0][1]
    assert reasons[1][0] == 9 and "inputs of different precisions" in reasons[1][1]
    # 2,620 TFLOP/s of FP8 on an H100 (dense peak 1,979): cannot be a dense GEMM
    assert reasons[2] == (10, "fp8 GEMM faster than the h100 dense peak: not a dense GEMM")
    # ... and takes the rest of its table (same GPU and types) with it, however plausible
    assert reasons[3] == (
        11,
        "f8e5m2xf8e4m3fn->bf16 table of h100 has 1 row(s) past the dense peak",
    )
    assert len(reasons) == 4


@pytest.mark.parametrize(
    "name, family",
    [
        ("H100 (sm_90; SKU not stated)", "h100"),
        ("B200", "b200"),
        ("AMD MI350 (gfx950)", "mi350"),
        ("MI350X", "mi350"),
        ("GB200-B200", "gb200"),
        ("A100-SXM4-80GB", "a100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("V100-SXM3-32GB", "v100"),
        ("Some New Chip (x)", "some-new-chip"),
    ],
)
def test_gpu_family(name, family):
    assert gpu_family(name) == family


# ---------------------------------------------------------------------------------------------
# CSV errors


def _rewrite_csv(src: Path, dst: Path, edit) -> None:
    with open(src, newline="") as fh:
        rows = list(csv.reader(fh))
    edit(rows)
    with open(dst, "w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows(rows)


@pytest.mark.parametrize(
    "reader, src, drop",
    [
        (read_e2e_csv, E2E, ("measured_iter_s", "hidden")),
        (read_collectives_csv, COLL, ("time_us",)),
        (read_gemm_csv, GEMM, ("dtype", "k")),
    ],
)
def test_missing_columns(tmp_path, reader, src, drop):
    dst = tmp_path / "x.csv"

    def edit(rows):
        idx = [rows[0].index(c) for c in drop]
        for row in rows:
            for i in sorted(idx, reverse=True):
                del row[i]

    _rewrite_csv(src, dst, edit)
    with pytest.raises(ReaderError, match="missing required") as e:
        reader(dst)
    msg = str(e.value)
    assert msg.startswith(f"{dst}:1: ")
    assert all(c in msg for c in drop)


@pytest.mark.parametrize(
    "reader, src, column, value",
    [
        (read_e2e_csv, E2E, "global_batch", "lots"),
        (read_e2e_csv, E2E, "tp", "2.5"),
        (read_collectives_csv, COLL, "size_bytes", "1MiB"),
        (read_collectives_csv, COLL, "group_size", "nan"),
        (read_gemm_csv, GEMM, "flops_per_s", "fast"),
    ],
)
def test_bad_cells(tmp_path, reader, src, column, value):
    dst = tmp_path / "x.csv"

    def edit(rows):
        rows[2][rows[0].index(column)] = value

    _rewrite_csv(src, dst, edit)
    with pytest.raises(ReaderError) as e:
        reader(dst)
    msg = str(e.value)
    assert msg.startswith(f"{dst}:3: ") and f"'{column}'" in msg and value in msg


def test_line_numbers_with_multiline_cells(tmp_path):
    dst = tmp_path / "x.csv"
    _rewrite_csv(GEMM, dst, lambda rows: rows[1].__setitem__(12, "two\nlines"))
    m = read_gemm_csv(dst)
    assert [g.where.line for g in m.gemms[:3]] == [2, 4, 5]


def test_ragged_row(tmp_path):
    dst = tmp_path / "x.csv"
    _rewrite_csv(COLL, dst, lambda rows: rows[3].append("extra"))
    with pytest.raises(ReaderError, match=r"x\.csv:4: 19 cells, the header has 18"):
        read_collectives_csv(dst)


# ---------------------------------------------------------------------------------------------
# load() and Measurements


def test_load_detects_formats(tmp_path):
    for f in (E2E, COLL, GEMM, NCCL_AR, NCCL_AG, NCCL_SR):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "README.md").write_text("not read: wrong suffix\n")
    assert [detect_kind(tmp_path / f.name) for f in (E2E, COLL, GEMM, NCCL_AR)] == [
        "e2e",
        "collectives",
        "gemm",
        "nccl-tests",
    ]
    # the all-gather log was measured on A100s: not a dgx-h100 measurement
    with pytest.raises(ReaderError, match=r"measured on NVIDIA A100-SXM4-80GB \(a100\)"):
        load([tmp_path], cluster=["dgx-h100"])
    (tmp_path / NCCL_AG.name).unlink()
    m = load([tmp_path], cluster=["dgx-h100"])
    assert (len(m.e2e), len(m.collectives), len(m.gemms)) == (3, 5 + 32 + 9, 6)
    assert {r.cluster for r in m.collectives if r.source_name == "nccl-tests"} == {"dgx-h100"}
    assert len(m.skipped) == 3 + 2 + 4
    single = load(str(tmp_path / GEMM.name))
    assert len(single.gemms) == 6
    with pytest.raises(ReaderError, match="give one"):
        load([tmp_path / NCCL_AR.name], cluster=["a", "b"])


def test_load_rejects_unknown_files(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\nworld\n")
    with pytest.raises(ReaderError, match="accepted: end-to-end CSV") as e:
        load([bad])
    assert str(e.value).startswith(f"{bad}:1: ")
    other = tmp_path / "other.csv"
    other.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ReaderError, match="nccl-tests stdout"):
        load([other])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReaderError, match="no \\*.csv"):
        load([empty])


@pytest.mark.parametrize("content", ["", "  \n\n\t\n"])
def test_empty_files(tmp_path, content):
    path = tmp_path / "results.txt"
    path.write_text(content)
    for read in (load, detect_kind, read_nccl_tests):
        with pytest.raises(ReaderError) as e:
            read(path)
        assert str(e.value) == f"{path}: the file is empty"
    csv_path = tmp_path / "runs.csv"
    csv_path.write_text(content)
    for read in (read_e2e_csv, read_collectives_csv, read_gemm_csv):
        with pytest.raises(ReaderError, match=f"^{csv_path}: the file is empty"):
            read(csv_path)


def test_missing_paths_and_directories(tmp_path):
    missing = tmp_path / "no-such.csv"
    for read in (detect_kind, read_nccl_tests, read_e2e_csv, read_collectives_csv, read_gemm_csv):
        with pytest.raises(ReaderError) as e:
            read(missing)
        assert str(e.value) == f"{missing}: no such file"
    # load() checks every path before it reads any file
    with pytest.raises(ReaderError, match=f"^{missing}: no such file or directory"):
        load([E2E, missing])
    # a directory where one file is expected; load() reads the files in it
    with pytest.raises(ReaderError, match="is a directory"):
        read_nccl_tests(tmp_path)
    shutil.copy(NCCL_AR, tmp_path / NCCL_AR.name)
    assert len(load(tmp_path, cluster="dgx-h100").collectives) == 32


@pytest.mark.parametrize("column", E2E_COLUMNS)
def test_e2e_required_columns_agree_with_validate(tmp_path, column):
    """diffcost validate and the calibration reader refuse the same incomplete files."""
    dst = tmp_path / "runs.csv"

    def edit(rows):
        i = rows[0].index(column)
        for row in rows:
            del row[i]

    _rewrite_csv(E2E, dst, edit)
    with pytest.raises(
        ReaderError, match=f"^{dst}:1: missing required end-to-end columns: {column}$"
    ):
        read_e2e_csv(dst)
    with pytest.raises(ValueError, match=rf"^{dst}: line 1: missing columns \['{column}'\]$"):
        read_rows(dst)


def test_e2e_optional_columns_may_be_absent(tmp_path):
    dst = tmp_path / "runs.csv"
    optional = ("ffn_hidden", "kv_heads", "vocab", "dp", "cp", "ep", "sp", "zero", "recompute")

    def edit(rows):
        idx = sorted((rows[0].index(c) for c in optional), reverse=True)
        for row in rows:
            for i in idx:
                del row[i]

    _rewrite_csv(E2E, dst, edit)
    assert len(read_e2e_csv(dst).e2e) == 3
    assert len(read_rows(dst)) == 6


def test_measurements_filter_and_add():
    e2e, coll, gemm = read_e2e_csv(E2E), read_collectives_csv(COLL), read_gemm_csv(GEMM)
    m = e2e + coll + gemm
    assert isinstance(m, Measurements)
    assert (len(m.e2e), len(m.collectives), len(m.gemms), len(m.skipped)) == (3, 5, 6, 9)
    assert sum([e2e, coll, gemm]).counts() == m.counts()
    assert m.counts()["skipped"]["blank time_us"] == 1

    vt = m.filter(cluster="vtrain-a100")
    assert [r.cluster.name for r in vt.e2e] == ["vtrain-a100"]
    assert [r.source_name for r in vt.collectives] == ["vtrain_allreduce_lut"]
    assert vt.gemms == [] and vt.skipped == m.skipped  # no A100 GEMMs in the fixture

    h100 = m.filter(gpu="h100")
    assert {r.cluster.name for r in h100.e2e} == {"mosaic-h100", "dgx-h100"}
    assert [r.cluster for r in h100.collectives] == ["gcp-a3-mega"]
    assert {g.gpu for g in h100.gemms} == {"h100"} and len(h100.gemms) == 2

    both = m.filter(cluster=["generic-mi350", "vtrain-a100"], gpu="MI350X")
    assert both.e2e == [] and [r.dtype for r in both.collectives] == ["bf16"]
    assert len(both.gemms) == 3

    src = m.filter(sources={"liplus_playground_nccl", "xla_default_matmul_perf_table"})
    assert len(src.collectives) == 1 and len(src.gemms) == 6 and src.e2e == []
    with pytest.raises(AttributeError):
        src.gemms[0].gpu = "x"  # frozen
    assert isinstance(src.gemms[0], GemmRecord)


# ---------------------------------------------------------------------------------------------
# The shared data set (counts quoted in shared/data/README.md)


needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"shared data set not present at {SHARED}"
)


@pytest.fixture(scope="module")
def shared():
    return {
        "e2e": read_e2e_csv(SHARED / "e2e" / "calibration.csv"),
        "coll": read_collectives_csv(SHARED / "collectives" / "collectives.csv"),
        "gemm": read_gemm_csv(SHARED / "kernels" / "gemm.csv"),
    }


@needs_shared
def test_shared_e2e(shared):
    m = shared["e2e"]
    assert len(m.e2e) == 1790 and len(m.e2e) + len(m.skipped) == 1794
    assert Counter(s.split(":")[0] for _, s in m.skipped) == {
        "architecture not given by the source": 4
    }
    assert {r.source_name for r in m.e2e} >= {"vtrain_ground_truth_single", "alpa_benchmark_readme"}


@needs_shared
def test_shared_collectives(shared):
    m = shared["coll"]
    path = SHARED / "collectives" / "collectives.csv"
    lut = [r for r in m.collectives if r.source_name == "vtrain_allreduce_lut"]
    assert len(lut) == 14336 and {r.collective for r in lut} == {"all_reduce"}
    assert len(m.collectives) + len(m.skipped) == 17798
    assert Counter(r.split(" not read")[0] for _, r in m.skipped) == {"collective 'permute'": 407}
    # spot check one record against its CSV line
    rec = lut[5000]
    with open(path, newline="") as fh:
        row = list(csv.DictReader(fh))[rec.where.line - 2]
    assert row["source"] == "vtrain_allreduce_lut"
    assert rec.size_bytes == float(row["size_bytes"])
    assert rec.time_s == pytest.approx(float(row["time_us"]) * 1e-6, rel=1e-12)
    assert rec.group_size == int(row["n_gpus"]) == rec.per_node and rec.cluster == row["cluster"]


@needs_shared
def test_shared_nccl_sample_matches_fixture(shared):
    """The all_reduce fixture holds the dgxc README sample; both readers agree."""
    csv_rows = [r for r in shared["coll"].collectives if r.source_name.startswith("nvidia_dgxc")]
    raw = read_nccl_tests(NCCL_AR, cluster="dgx-h100").collectives
    assert [(r.size_bytes, r.time_s, r.group_size, r.per_node) for r in csv_rows] == [
        (r.size_bytes, pytest.approx(r.time_s), r.group_size, r.per_node) for r in raw
    ]


@needs_shared
def test_shared_gemm(shared):
    m = shared["gemm"]
    assert Counter(g.gpu for g in m.gemms) == {"h100": 750, "b200": 1875, "mi350": 3750}
    assert len(m.gemms) + len(m.skipped) == 9750
    reasons = Counter(r for _, r in m.skipped)
    assert sum(v for r, v in reasons.items() if "fp8 GEMM with f8e" in r) == 1875
    assert reasons["fp8 GEMM faster than the h100 dense peak: not a dense GEMM"] == 87
    assert reasons["fp8 GEMM faster than the mi350 dense peak: not a dense GEMM"] == 4
    # every H100 FP8 table has rows past the peak; one of MI350's eight FP8 tables has
    tables = {r: v for r, v in reasons.items() if "past the dense peak" in r}
    assert tables == {
        "f8e4m3fnxf8e4m3fn->bf16 table of h100 has 29 row(s) past the dense peak": 346,
        "f8e4m3fnxf8e5m2->bf16 table of h100 has 28 row(s) past the dense peak": 347,
        "f8e5m2xf8e4m3fn->bf16 table of h100 has 30 row(s) past the dense peak": 345,
        "f8e5m2xf8e4m3fn->bf16 table of mi350 has 4 row(s) past the dense peak": 371,
    }
    assert len(m.skipped) == 1875 + 87 + 4 + 1125 - 87 + 375 - 4
    assert not any(g.gpu == "h100" and g.precision == "fp8" for g in m.gemms)
    assert Counter(g.precision for g in m.gemms if g.gpu == "mi350") == {
        "fp8": 1875,
        "bf16": 750,
        "fp16": 750,
        "fp32": 375,
    }
