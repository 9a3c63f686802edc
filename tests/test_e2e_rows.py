"""``benchmarks/e2e_rows.predictable``: the rows the benchmarks predict, with the constants
``diffcost validate`` predicts them with (the row's cluster and software stack)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from diffcost import api
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays
from diffcost.validate import validate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import e2e_rows  # noqa: E402

E2E = Path(__file__).parent / "data" / "readers_e2e.csv"


def test_predictable_rows_predict_as_validate_does():
    """Each row's iteration time from ``predictable``'s constants equals ``validate``'s, whose
    constants include the row's stack offsets (the three rows' stacks differ)."""
    got = {}
    for i, _, model, plan, cluster, params in e2e_rows.predictable(E2E):
        out = api.simulate_jit(
            model_arrays(model), plan_arrays(plan), cluster_arrays(cluster), params
        )
        got[i] = float(np.asarray(out.iteration_s))
    rows = {r["row"]: r["predicted_iter_s"] for r in validate(E2E)["rows"]}
    both = [i for i in got if rows.get(i) is not None]
    assert len(both) >= 3
    for i in both:
        assert got[i] == pytest.approx(rows[i], rel=1e-5), i
