"""benchmarks/collective_floor.py: each free curve recovers a table of its own form, and the
benchmark reads a collectives CSV into per-cluster figures."""

import csv
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
_spec = importlib.util.spec_from_file_location("collective_floor", _DIR / "collective_floor.py")
cf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cf)

SIZES = 2.0 ** np.arange(20, 31)  # 1 MiB .. 1 GiB


def _two_regime(x):  # 30 us + 100 GB/s below 16 MiB, 400 GB/s above, the curve's own step
    below, above = cf._step(np.log2(x), 24.0)
    return 30.0 + x / 1e5 * (below + 0.25 * above)


@pytest.mark.parametrize("kind", cf.KINDS)
def test_an_affine_table_is_fitted_exactly(kind):
    t = 25.0 + SIZES / 3e5
    inside, held = cf.table_errors(kind, SIZES, t)
    tol = 0.05 if kind == "loglog_cubic" else 1e-3  # a cubic in log-log only approximates it
    assert np.max(inside) < tol
    assert held is not None and np.mean(held) < tol


def test_only_the_two_regime_curve_follows_a_bandwidth_switch():
    t = _two_regime(SIZES)
    two, _ = cf.table_errors("two_regime", SIZES, t)
    one, _ = cf.table_errors("affine", SIZES, t)
    assert np.max(two) < 1e-3 and np.mean(one) > 0.05


def test_measure_reads_tables_by_cluster(tmp_path):
    (tmp_path / "collectives").mkdir()
    with open(tmp_path / "collectives" / "collectives.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["cluster", "collective", "group_size", "n_groups", "size_bytes", "time_us"])
        for x, t in zip(SIZES, _two_regime(SIZES)):
            w.writerow(["c1", "all_gather", 8, 1, int(x), t])
            w.writerow(["c1", "send_recv", 2, 1, int(x), t])  # not a priced collective
        w.writerow(["c1", "all_gather", 8, 1, 2**19, 5.0])  # below 1 MiB
    out = cf.measure(tmp_path)
    assert out["c1"]["rows"] == len(SIZES) and out["c1"]["tables"] == 1
    assert out["c1"]["two_regime_pct"] < out["c1"]["affine_pct"]
    assert out["c1"]["two_regime_heldout_pct"] is not None
