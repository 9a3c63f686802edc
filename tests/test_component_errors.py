"""benchmarks/component_errors.py on hand-made measured and predicted composed times."""

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest
from helpers import SHARED_DATA

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
_spec = importlib.util.spec_from_file_location("component_errors", _DIR / "component_errors.py")
ce = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ce)

LAYOUT = [(layers, gb) for layers in (12, 16, 20, 24) for gb in (8, 16, 32)]
SHAPES = list(itertools.product((1, 2, 4, 8), (1024, 2048), (1, 2)))  # tp, hidden, microbatch


def _composed(a, b, c, d):
    return lambda layers, n: a + b * layers + n * (c + d * layers)


def _rows_and_predictions(measured_of, predicted_of):
    """e2e rows (one cell per shape) and cv rows whose predictions come from ``predicted_of``."""
    rows, cv = [], []
    for shape in SHAPES:
        tp, hidden, mb = shape
        for layers, gb in LAYOUT:
            r = {k: "x" for k in ce.layer_composition.CELL_KEY}
            r.update(
                source="s",
                tp=str(tp),
                hidden=str(hidden),
                pp="1",
                dp="1",
                microbatch=str(mb),
                n_layers=str(layers),
                global_batch=str(gb),
                measured_iter_s=str(measured_of(shape)(layers, gb / mb)),
                row=str(len(rows) + 1),
            )
            rows.append(r)
            cv.append({"row": r["row"], "cv_predicted_s": predicted_of(shape)(layers, gb / mb)})
    return rows, cv


def _true(shape):
    tp, hidden, mb = shape
    return _composed(0.003, 1e-4, 0.004 * mb, 0.003 * mb * hidden / 1024 / tp)


def test_substituting_measured_components_removes_their_error():
    def predicted(shape):  # per-microbatch term 50% high, per-layer term 10% low
        tp, hidden, mb = shape
        return _composed(0.003, 1e-4, 0.006 * mb, 0.0027 * mb * hidden / 1024 / tp)

    out = ce.analyse(ce.cells_with_predictions(*_rows_and_predictions(_true, predicted)))
    assert out["cells"] == len(SHAPES) and out["rows"] == len(SHAPES) * len(LAYOUT)
    assert out["fix_none"]["mape_pct"] > 1.0
    assert out["fix_c+d"]["max_ape_pct"] == pytest.approx(0.0, abs=1e-9)
    assert out["fix_all"]["max_ape_pct"] == pytest.approx(0.0, abs=1e-9)
    assert out["fix_a+b"]["mape_pct"] == pytest.approx(out["fix_none"]["mape_pct"], rel=1e-9)
    assert 0.0 < out["fix_d"]["mape_pct"] and 0.0 < out["fix_c"]["mape_pct"]
    assert list(out["mean_log_by_tp"]["all"]) == [1, 2, 4, 8]
    assert max(map(abs, out["mean_log_by_tp"]["all"].values())) < 1e-9


def test_a_smooth_per_shape_error_is_corrected_without_seeing_the_shape():
    def predicted(shape):  # c and d off by factors linear in log2 of the shape
        tp, hidden, mb = shape
        f = np.exp(0.1 * np.log2(tp) - 0.05 * np.log2(mb))
        g = np.exp(-0.08 * np.log2(tp) + 0.1 * np.log2(hidden / 1024))
        return _composed(0.003, 1e-4, 0.004 * mb * f, 0.003 * mb * hidden / 1024 / tp * g)

    out = ce.analyse(ce.cells_with_predictions(*_rows_and_predictions(_true, predicted)))
    assert out["fix_none"]["mape_pct"] > 2.0
    assert out["smooth_c_d_degree1"]["max_ape_pct"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.skipif(not (SHARED_DATA / "e2e" / "calibration.csv").is_file(), reason="no data")
def test_command_line_reports_the_vtrain_components(capsys):
    assert ce.main(["--data", str(SHARED_DATA)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vtrain_ground_truth_single: ") and "fix_c+d" in out
    assert ce.main(["--data", str(SHARED_DATA), "--cv-rows", "/nonexistent.csv"]) == 2


def test_transfer_rows_predictions_are_read_from_their_column():
    rows, cv = _rows_and_predictions(_true, _true)
    transfer = [{"row": r["row"], "predicted_s": str(r["cv_predicted_s"])} for r in cv]
    out = ce.analyse(ce.cells_with_predictions(rows, transfer))
    assert out["fix_none"]["max_ape_pct"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.skipif(not (SHARED_DATA / "e2e" / "calibration.csv").is_file(), reason="no data")
def test_command_line_reads_the_transfer_rows_file(capsys, tmp_path):
    path = tmp_path / "transfer_rows.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        fh.write("group,row,source,predicted_s\n")
        fh.write("cluster: vtrain-a100,1,vtrain_ground_truth_single,1.0\n")
    assert ce.main(["--data", str(SHARED_DATA), "--cv-rows", str(path)]) == 0
    assert "no cell" in capsys.readouterr().out  # the cluster group's rows are not read
