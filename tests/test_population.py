"""A cluster without a profile of its own gets the population's cluster constants: the mean
of the clusters the shipped fit has end-to-end runs of."""

import numpy as np
import pytest

from calibration import command
from calibration import fit as fit_mod
from diffcost import profiles as prof
from diffcost.config import load_cluster
from diffcost.params import default_params


def test_a_cluster_without_profile_gets_the_population(tmp_path, monkeypatch):
    monkeypatch.setattr(prof, "PROFILES_DIR", tmp_path)
    selene, vtrain = load_cluster("selene-a100-80g"), load_cluster("vtrain-a100")
    _, note = prof.params_for(selene)
    assert "datasheet defaults" in note
    prof.write_profile(
        prof.population_path(), {"host_op_s": 3e-5}, {"layer": "population", "key": "population"}
    )
    prof.write_profile(prof.cluster_path("vtrain-a100"), {"host_op_s": 7e-6}, {"layer": "cluster"})
    params, note = prof.params_for(selene)
    assert float(params.host_op_s) == pytest.approx(3e-5)
    assert "population.yaml" in note and "mean of the fitted clusters" in note
    own, note = prof.params_for(vtrain)  # a cluster's own profile wins
    assert float(own.host_op_s) == pytest.approx(7e-6) and "population.yaml" not in note
    none, _ = prof.params_for(selene, "none")
    assert float(none.host_op_s) == pytest.approx(float(default_params().host_op_s))


def test_population_values_average_raw_constants_and_leave_grids_out():
    p0 = default_params()
    a = p0.replace(host_op_log_s=np.log(1e-5), cluster_layer_log_time=p0.cluster_layer_log_time + 1)
    b = p0.replace(host_op_log_s=np.log(4e-5))
    result = fit_mod.FitResult({}, {}, {"a": a, "b": b}, [], 0, 0.0, True, {}, {})
    values = command.population_values(result, ["a", "b"])
    assert values["host_op_s"] == pytest.approx(2e-5)  # geometric mean: raw values are logs
    assert prof.CLUSTER_LAYER_FIELD not in values and prof.HEAD_FIELD not in values
    with pytest.raises(ValueError, match="no cluster"):
        command.population_values(result, [])
