"""Per-source offsets in the fit: indexed by the problem, added by ``assemble``, fitted only for
the sources with weighted runs, and 0 for a source the fit has not seen."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from calibration import fit as fit_mod
from calibration import heldout
from calibration.readers import read_e2e_csv
from diffcost.params import default_params

SAMPLE = Path(__file__).parent / "data" / "e2e_sample.csv"


def _tables(n_sources):
    p0 = default_params()
    dev = {leaf: jnp.stack([getattr(p0, leaf)]) for leaf in fit_mod.DEVICE_LEAVES}
    clu = {leaf: jnp.stack([getattr(p0, leaf)]) for leaf in fit_mod.CLUSTER_LEAVES}
    clu.update({key: jnp.zeros(1) for key in fit_mod.STACK_KEYS})
    clu.update({key: jnp.zeros(n_sources) for key in fit_mod.SOURCE_KEYS})
    return p0, dev, clu


def test_assemble_adds_the_row_source_offset_on_top_of_the_stack_offset():
    p0, dev, clu = _tables(2)
    clu["stack/host_op_log_s"] = jnp.array([0.5])
    clu["source/host_op_log_s"] = jnp.array([0.0, 0.25])
    zeros = jnp.zeros(3, int)
    p = fit_mod.assemble(dev, clu, zeros, zeros, zeros, jnp.array([1, 0, -1]))
    np.testing.assert_allclose(p.host_op_log_s, p0.host_op_log_s + np.array([0.75, 0.5, 0.5]))


def test_the_problem_indexes_each_run_by_its_source():
    meas = read_e2e_csv(SAMPLE)
    problem = fit_mod.build_problem(meas)
    r = np.asarray(problem.data["e2e"]["r"])
    assert problem.sources == sorted({x.source_name for x in meas.e2e})
    assert [problem.sources[i] for i in r] == [x.source_name for x in meas.e2e]


def test_a_fit_moves_only_the_offsets_of_sources_with_weighted_runs():
    meas = read_e2e_csv(SAMPLE)
    problem = fit_mod.build_problem(meas)
    held = problem.sources[0]
    keep = np.array([x.source_name != held for x in meas.e2e])
    weights = {lvl: np.ones(n) for lvl, n in problem.counts.items()}
    weights["e2e"] = keep.astype(float)
    cfg = fit_mod.FitConfig(steps=40)
    _, tables, _ = heldout.run_fit(problem, heldout.subset(meas, e2e=keep), weights, cfg)
    offsets = np.stack([np.asarray(tables[1][k]) for k in fit_mod.SOURCE_KEYS])
    assert np.all(offsets[:, 0] == 0.0)  # the held-out source stays at the population
    assert np.abs(offsets[:, 1:]).max() > 1e-4
    off = fit_mod.FitConfig(steps=40, sources=False)
    _, tables, _ = heldout.run_fit(problem, heldout.subset(meas, e2e=keep), weights, off)
    assert all(np.all(np.asarray(tables[1][k]) == 0.0) for k in fit_mod.SOURCE_KEYS)


def test_map_tables_gives_a_known_source_its_offset_and_an_unknown_one_none():
    meas = read_e2e_csv(SAMPLE)
    problem = fit_mod.build_problem(meas)
    tables = fit_mod.initial_tables(problem)
    key = "source/host_op_log_s"
    tables[1][key] = jnp.arange(1.0, len(problem.sources) + 1.0)
    rows = [x for x in meas.e2e if x.source_name == problem.sources[-1]][:1]
    target = fit_mod.build_problem(heldout.Measurements(e2e=rows))
    n_fam, n_clu = len(target.families), len(target.clusters)
    fams, clus = set(problem.families), set(problem.clusters)
    _, clu = heldout.map_tables(problem, tables, fams, clus, target, n_fam, n_clu, n_src=3)
    np.testing.assert_allclose(clu[key], [len(problem.sources), 0.0, 0.0])
    other = fit_mod.Problem(problem.families, problem.clusters, {}, {}, ["elsewhere"])
    _, clu = heldout.map_tables(other, tables, fams, clus, target, n_fam, n_clu)
    np.testing.assert_allclose(clu[key], [0.0])
