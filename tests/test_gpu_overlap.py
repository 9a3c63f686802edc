"""benchmarks/gpu_overlap.py's summary of its SM-sharing rows, on synthetic rows and on the
H200 measurements kept in benchmarks/results/h200/."""

import csv
import importlib.util
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
_spec = importlib.util.spec_from_file_location("gpu_overlap", _DIR / "gpu_overlap.py")
go = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(go)


def _row(kind, ctas, slowdown, overlapped=1):
    return {
        "occupier": kind,
        "ctas": str(ctas),
        "sms": "132",
        "slowdown": str(slowdown),
        "overlapped": str(overlapped),
    }


def test_summary_slope_and_means():
    # slowdown - 1 = 0.5 x the share of SMs held, two rows per CTA count
    rows = [_row("spin", c, 1.0 + 0.5 * c / 132) for c in (8, 16, 32) for _ in range(2)]
    rows.append(_row("spin", 64, 9.0, overlapped=0))  # the occupier ended first: left out
    got = go.summarize(rows)["spin"]
    assert got["rows"] == 6
    assert got["slope_per_sm_share"] == pytest.approx(0.5)
    assert got["slowdown"] == pytest.approx({c: 1.0 + 0.5 * c / 132 for c in (8, 16, 32)})


def test_summary_skips_kinds_without_overlapped_rows():
    assert go.summarize([_row("copy", 8, 2.0, overlapped=0)]) == {}


def test_h200_measurements_summarize():
    rows = list(csv.DictReader(open(_DIR / "results" / "h200" / "overlap" / "overlap.csv")))
    got = go.summarize(rows)
    assert set(got) == {"spin", "copy"} and all(v["rows"] == 16 for v in got.values())
    # holding half the SMs costs a GEMM less than twice its time: the rest run at higher clocks
    assert all(1.0 < v["slowdown"][66] < 2.0 for v in got.values())
