"""A cluster without a profile of its own gets the population's cluster constants: the mean
of the clusters the shipped fit has end-to-end runs of."""

import jax.numpy as jnp
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
    clu = {
        leaf: jnp.stack([getattr(p0, leaf)] * 3) for leaf in fit_mod.CLUSTER_LEAVES
    }  # clusters a, b, c
    clu["host_op_log_s"] = jnp.log(jnp.array([1e-5, 4e-5, 9e-3]))
    clu[fit_mod.CLUSTER_LAYER_LEAF] = clu[fit_mod.CLUSTER_LAYER_LEAF].at[0].add(1.0)
    problem = fit_mod.Problem(families=[], clusters=["a", "b", "c"], data={}, counts={})
    result = fit_mod.FitResult({}, {}, {}, [], 0, 0.0, True, {}, {}, tables=({}, clu))
    values = command.population_values(result, problem, ["a", "b"])  # c is left out
    assert values["host_op_s"] == pytest.approx(2e-5)  # geometric mean: raw values are logs
    assert prof.CLUSTER_LAYER_FIELD not in values and prof.HEAD_FIELD not in values
    with pytest.raises(ValueError, match="at least one fitted cluster"):
        command.population_values(result, problem, [])
