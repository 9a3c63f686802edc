"""benchmarks/tp_terms.py: the straggler statistic, the fitted terms on hand-made runs, and the
script on the committed zero-shot rows."""

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import SHARED_DATA

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
_spec = importlib.util.spec_from_file_location("tp_terms", _DIR / "tp_terms.py")
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)

EXPECTED_MAX = {1: 0.0, 2: 0.5642, 4: 1.0294, 8: 1.4236}  # tables of normal order statistics


@pytest.mark.parametrize("n", sorted(EXPECTED_MAX))
def test_expected_max_of_normals_matches_the_tables(n):
    assert tt.expected_max_normal(n) == pytest.approx(EXPECTED_MAX[n], abs=1e-4)


def test_a_ring_cost_added_to_the_measurements_is_recovered():
    k_s = 0.4e-3  # seconds per ring step, layer and microbatch
    runs = []
    for tp in (1, 2, 4, 8):
        for mb in (1, 2):
            slots = 24.0 * 16 / mb
            pred = 1e-3 * slots * (1.0 + mb / tp)
            runs.append({"tp": tp, "mb": mb, "slots": slots, "pred": pred,
                         "meas": pred + k_s * (tp - 1) * slots})  # fmt: skip
    out = tt.terms(runs)
    assert out["as_predicted"]["mean_log_by_tp_pct"][1] == pytest.approx(0.0)
    assert out["as_predicted"]["mean_log_by_tp_pct"][8] < -10.0
    assert out["tp_minus_1"]["k_ms"] == pytest.approx(1e3 * k_s)
    assert out["tp_minus_1"]["mape_pct"] == pytest.approx(0.0, abs=1e-9)
    assert out["step_at_tp8"]["mape_pct"] > 1.0


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="needs the shared data")
def test_the_script_reads_the_committed_rows(capsys):
    assert tt.main(["--data", str(SHARED_DATA), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 1440
    assert set(out["floor_ms_microbatch1"]["1024"]) == {"1", "2", "4", "8"}
    assert len(out["same_work"]) == 6
    assert out["terms"]["as_predicted"]["mean_log_by_tp_pct"]["8"] < -10.0
    mape = [out["oracle"][k]["mape_pct"] for k in ("tp", "tp_microbatch", "layer_shape")]
    assert mape == sorted(mape, reverse=True)
    assert tt.main(["--data", str(SHARED_DATA), "--source", "nope"]) == 2
