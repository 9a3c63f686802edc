"""benchmarks/gpu_measure.py writes files the readers take, and the H100 and H200 measurements
kept in benchmarks/results/h100/ and h200/ stay readable."""

import csv
import importlib.util
import json
from pathlib import Path

import jax
import pytest

from calibration.readers import load

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
_spec = importlib.util.spec_from_file_location("gpu_measure", _DIR / "gpu_measure.py")
gm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gm)


@pytest.fixture
def tiny(monkeypatch):
    """Shapes small enough for the CPU; every row kept whatever its time."""
    monkeypatch.setattr(gm, "GEMM_TOKENS", (64,))
    monkeypatch.setattr(gm, "GEMM_HIDDEN", (32,))
    # attention large enough that its backward, timed as (fwd + bwd) - fwd, stands clear of the
    # timing noise of a loaded machine (a few ms on the CPU)
    monkeypatch.setattr(gm, "ATTN_SHAPES", ((128, 4, 4, 32),))
    monkeypatch.setattr(gm, "ATTN_TOKENS", 512)
    monkeypatch.setattr(gm, "MEM_BYTES", (1 << 12,))
    monkeypatch.setattr(
        gm,
        "E2E_CONFIGS",
        (("GPT-tiny", 2, 32, 2, 64, 2, "none"), ("GPT-tiny", 2, 32, 2, 64, 2, "full")),
    )
    monkeypatch.setattr(gm, "VOCAB", 128)
    monkeypatch.setattr(gm, "MIN_BATCH_S", 0.0)
    monkeypatch.setattr(gm, "DISPATCH_MARGIN", 0.0)
    # the script runs where JAX has its defaults: float32, standard dtype promotion
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        yield


def test_written_files_read_back(tiny, tmp_path):
    assert gm.main(["--out", str(tmp_path), "--steps", "2"]) == 0
    meas = load(tmp_path)
    assert (len(meas.gemms), len(meas.attention), len(meas.memory), len(meas.e2e)) == (4, 2, 2, 2)
    assert all(r.sustained for r in meas.gemms + meas.attention)  # timed back to back
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["failures"] == [] and meta["rows"] == {"kernels": 8, "e2e": 2}
    rows = list(csv.DictReader(open(tmp_path / "e2e.csv")))
    assert [r["recompute"] for r in rows] == ["none", "full"]
    assert all(
        float(r["measured_iter_s"]) > 0 and float(r["measured_peak_mem_gib"]) > 0 for r in rows
    )
    # the full-recompute step keeps fewer activations: XLA assigns it less memory
    assert float(rows[1]["measured_peak_mem_gib"]) < float(rows[0]["measured_peak_mem_gib"])


def test_dispatch_bound_rows_left_out(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(gm, "DISPATCH_MARGIN", 1e9)
    assert gm.main(["--out", str(tmp_path), "--only", "kernels"]) == 0
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["rows"] == {"kernels": 0}
    assert len(meta["failures"]) == 4 + 1 + 2 and all("dispatch" in f for f in meta["failures"])


@pytest.mark.parametrize("name,counts", [("h100", (41, 32, 3, 24)), ("h200", (45, 32, 4, 25))])
def test_measurements_read(name, counts):
    meas = load(_DIR / "results" / name)
    got = (len(meas.gemms), len(meas.attention), len(meas.memory), len(meas.e2e))
    assert got == counts and not meas.skipped


def test_skip_configs_leaves_out_the_first(tiny, tmp_path):
    argv = ["--out", str(tmp_path), "--only", "e2e", "--steps", "1", "--skip-configs", "1"]
    assert gm.main(argv) == 0
    rows = list(csv.DictReader(open(tmp_path / "e2e.csv")))
    assert [r["recompute"] for r in rows] == ["full"]


def test_attention_alone_at_the_long_shapes(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(gm, "ATTN_LONG_SHAPES", ((256, 4, 1, 32), (256, 4, 4, 32)))
    argv = ["--out", str(tmp_path), "--only", "attention", "--attn-set", "long"]
    assert gm.main(argv) == 0
    rows = list(csv.DictReader(open(tmp_path / "kernels.csv")))
    assert [(r["op"], r["kv_heads"]) for r in rows] == [
        ("attention_fwd", "1"),
        ("attention_bwd", "1"),
        ("attention_fwd", "4"),
        ("attention_bwd", "4"),
    ]
    assert {r["seq_len"] for r in rows} == {"256"}
    assert not (tmp_path / "e2e.csv").exists()
    assert len(load(tmp_path).attention) == 4
