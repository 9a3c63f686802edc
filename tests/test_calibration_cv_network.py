"""benchmarks/calibration_cv_network.py: a fold's held-out rows priced on the three paths and
checked against calibration_cv.py's held-out predictor, without fits (the datasheet defaults
stand in for a fold's tables)."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import GPT, PLANS

from calibration import fit as fit_mod
from calibration.heldout import Predictor
from calibration.records import E2ERecord, Measurements
from diffcost.config import load_cluster
from diffcost.specs import PlanSpec

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(_DIR))  # calibration_cv_network imports its sibling scripts
_spec = importlib.util.spec_from_file_location("cv_network", _DIR / "calibration_cv_network.py")
cvn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cvn)

# The existing path priced one row at a time against the batched held-out predictor (float32)
REPRODUCE_RTOL = cvn.NP.CHECK_RTOL
# On one node the graph's collectives differ from the ring-share table's by under 1e-6
ONE_NODE_RTOL = 1e-5


@pytest.fixture(scope="module")
def priced_rows():
    """Two one-node runs and a two-node one on DGX H100, priced on every path and by the
    held-out predictor, with the default tables."""
    cluster = load_cluster("dgx-h100")
    plans = [PLANS["dp8"], PLANS["gpipe"],
             PlanSpec(dp=16, microbatch=2, global_batch=128, overlap_dp=True)]  # fmt: skip
    rows = [E2ERecord(GPT, plan, cluster, 1.0 + 0.5 * i, "synthetic", i, (), None)
            for i, plan in enumerate(plans)]  # fmt: skip
    problem = fit_mod.build_problem(Measurements(e2e=rows))
    tables = fit_mod.initial_tables(problem)
    fams, clus = set(problem.families), set(problem.clusters)
    temperature = fit_mod.FitConfig().temperature
    n_fam, n_clu = len(fams), len(clus)
    preds = cvn.NP.GraphPricer(n_fam, n_clu, temperature)(rows, problem, tables, fams, clus)
    preds["cv"] = Predictor(len(rows), n_fam, n_clu, temperature)(rows, problem, tables, fams, clus)
    log_meas = np.log([r.measured_iter_s for r in rows])
    return rows, preds, log_meas


def test_fold_rows_reproduce_the_cv_prediction_and_agree_on_one_node(priced_rows):
    rows, preds, log_meas = priced_rows
    assert all(np.all(np.isfinite(v)) for v in preds.values())
    g = cvn.group_result("all", np.ones(len(rows), bool), preds, log_meas)
    assert g["reproduces_cv"] and g["max_rel_diff_vs_cv"] <= REPRODUCE_RTOL
    assert g["rows"] == len(rows)
    one_node = np.array([r.plan.n_gpus <= r.cluster.gpus_per_node for r in rows])
    np.testing.assert_allclose(
        preds["graph"][one_node], preds["comm"][one_node], rtol=ONE_NODE_RTOL
    )
    m = g["graph_contention_rows"]
    assert m["moved"] == m["closer"] + m["further"] <= len(rows)
    for p in ("graph", "graph_contention"):
        assert g["shift"][p]["max_abs_pct"] >= abs(g["shift"][p]["mean_pct"])
        assert np.isclose(g["shift"][p]["mape_change_pts"],
                          g[p]["mape_pct"] - g["comm"]["mape_pct"])  # fmt: skip


def test_a_group_off_the_cv_prediction_is_flagged_and_unpriced_rows_are_left_out(priced_rows):
    rows, preds, log_meas = priced_rows
    off = {**preds, "cv": preds["cv"] + np.array([0.0, 1e-3, 0.0])}
    assert not cvn.group_result("all", np.ones(len(rows), bool), off, log_meas)["reproduces_cv"]
    # a row of a fold not run has no CV prediction: no group counts it
    partial = {**preds, "cv": np.where(np.arange(len(rows)) == 2, np.nan, preds["cv"])}
    st = SimpleNamespace(src=np.array(["a", "b", "b"]), e2e_family=np.array(["h100"] * 3),
                         log_meas=log_meas)  # fmt: skip
    groups = {g["name"]: g for g in cvn.groups(st, partial)}
    assert {k: g["rows"] for k, g in groups.items()} == {"source: a": 1, "source: b": 1,
                                                         "h100": 2, "all": 2}  # fmt: skip
    assert all(g["reproduces_cv"] for g in groups.values())
