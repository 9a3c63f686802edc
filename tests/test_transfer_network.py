"""benchmarks/transfer_network.py: held-out rows priced one at a time on the existing path and
on their cluster's own graph, with a fold's tables mapped as transfer.py maps them. (That the
existing path reproduces transfer.py's batched prediction is checked on every row by the
benchmark itself: ``reproduces_transfer``.)"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
from helpers import GPT, PLANS

from calibration import fit as fit_mod
from calibration.records import E2ERecord, Measurements
from diffcost.config import load_cluster

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(_DIR))  # transfer_network imports its sibling scripts
_spec = importlib.util.spec_from_file_location("transfer_network", _DIR / "transfer_network.py")
tn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tn)

# On one node the graph's collectives differ from the ring-share table's by under 1e-6
# (8e-7 measured on dp 8, 2026-11-27); anything larger is a different network
ONE_NODE_RTOL = 1e-5


def test_one_node_graph_agrees_with_the_existing_path():
    """Jobs inside one NVSwitch node (data parallel; a pipeline with data parallel) on the
    graph the cluster describes (``topology: cluster``, without contention) take the time the
    existing path gives, with the same fold tables (the defaults here)."""
    cluster = load_cluster("dgx-h100")
    rows = [E2ERecord(GPT, PLANS[p], cluster, 1.0, "synthetic", i, (), None)
            for i, p in enumerate(("dp8", "gpipe"))]  # fmt: skip
    assert all(r.plan.n_gpus <= cluster.gpus_per_node for r in rows)
    problem = fit_mod.build_problem(Measurements(e2e=rows))
    tables = fit_mod.initial_tables(problem)
    fams, clus = set(problem.families), set(problem.clusters)
    pricer = tn.GraphPricer(len(fams), len(clus), 1e-3, paths=("comm", "graph"))
    out = pricer(rows, problem, tables, fams, clus)
    assert np.all(np.isfinite(out["comm"]))
    np.testing.assert_allclose(out["graph"], out["comm"], rtol=ONE_NODE_RTOL)
