"""MLPerf rows priced outside the transformer core, as the fit's row sets
(``calibration.mlperf_fit``: ``predict_log`` calls their ``log_times``).

* ``GraphRows``: data-parallel operator-graph runs (``mlperf_models.GraphRecord``), one
  ``opgraph.data_parallel.data_parallel_step_s`` per row, vectorized over rows (every row's
  graph is the same model at its own batch, so the per-operator arrays stack);
* ``DlrmRows``: DLRM runs (``mlperf_models.DlrmRecord``), ``dlrm_cost`` of each row's HugeCTR
  plan (rows on different GPU counts have differently shaped problems: a loop over rows), plus
  the evaluation the logged throughput includes: ``DLRM_EVAL_PER_TRAIN`` times the forward
  pass per step (an evaluated sample taken to cost what a trained sample's forward does).

Both put the fit's offsets (``mlperf_fit.offsets_of``) on each row's shipped profile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from calibration.mlperf_fit import FamilyOffsets, families_of, offsets_of
from calibration.mlperf_models import (
    DLRM_EVAL_PER_TRAIN,
    GRAPH_GRAD_BYTES,
    DlrmRecord,
    GraphRecord,
    dlrm_problem_plan,
    zoo_graph_arrays,
    zoo_param_count,
)
from diffcost.arrays import cluster_arrays, stack
from diffcost.dlrm_cost import dlrm_cost
from diffcost.opgraph.data_parallel import data_parallel_step_s
from diffcost.profiles import params_for
from diffcost.stacks import apply_stack


@struct.dataclass
class GraphRows(FamilyOffsets):
    """Data-parallel graph runs as stacked arrays (``[n_rows]`` leading axis)."""

    graph: object  # stacked GraphArrays
    n_gpus: np.ndarray
    n_params: np.ndarray
    grad_bytes: np.ndarray
    cluster: object
    params: object
    log_meas: np.ndarray
    family: np.ndarray
    families: tuple = struct.field(pytree_node=False)

    @classmethod
    def of(cls, records: list[GraphRecord]) -> GraphRows:
        graphs = [zoo_graph_arrays(r.zoo_model, r.local_batch) for r in records]
        shapes = {tuple(g.gemm.shape) for g in graphs}
        if len(shapes) != 1:
            raise ValueError(f"GraphRows: the rows' graphs differ in operators ({shapes})")
        n_params = np.array([zoo_param_count(r.zoo_model) for r in records], float)
        family, families = families_of(records)
        return cls(
            graph=stack(graphs),
            n_gpus=np.array([r.n_gpus for r in records], float),
            n_params=n_params,
            grad_bytes=n_params * GRAPH_GRAD_BYTES,
            cluster=stack([cluster_arrays(r.cluster) for r in records]),
            params=stack([params_for(r.cluster)[0] for r in records]),
            log_meas=np.log([r.measured_iter_s for r in records]),
            family=family,
            families=families,
        )

    def log_times(self, raw, temperature):
        def one(g, n, n_params, grad_bytes, c, params, family):
            params = apply_stack(params, offsets_of(raw, family))
            step = data_parallel_step_s(g, n, n_params, grad_bytes, c, params, temperature)
            return step.iteration_s

        args = (self.graph, self.n_gpus, self.n_params, self.grad_bytes, self.cluster)
        return jnp.log(jax.vmap(one)(*args, self.params, self.family))


_PLANS: dict = {}


def problem_plan(r: DlrmRecord):
    """``mlperf_models.dlrm_problem_plan`` of ``r``, found once per model, batch, cluster and
    GPU count (the plan depends on nothing else; repeated systems share it)."""
    key = (r.spec, r.cluster.name, r.n_gpus)
    if key not in _PLANS:
        _PLANS[key] = dlrm_problem_plan(r)
    return _PLANS[key]


@struct.dataclass
class DlrmRows(FamilyOffsets):
    """DLRM runs: each row's sharding problem (on its shipped profile) and HugeCTR plan."""

    problems: tuple
    plans: tuple
    log_meas: np.ndarray
    family: np.ndarray
    families: tuple = struct.field(pytree_node=False)

    @classmethod
    def of(cls, records: list[DlrmRecord]) -> DlrmRows:
        pairs = [problem_plan(r) for r in records]
        family, families = families_of(records)
        return cls(
            problems=tuple(p for p, _ in pairs),
            plans=tuple(q for _, q in pairs),
            log_meas=np.log([r.measured_iter_s for r in records]),
            family=family,
            families=families,
        )

    def log_times(self, raw, temperature):
        out = []
        for i, (problem, plan) in enumerate(zip(self.problems, self.plans)):
            params = apply_stack(problem.params, offsets_of(raw, self.family[i]))
            cost = dlrm_cost(problem.replace(params=params), plan, temperature)
            out.append(cost.iteration_s + DLRM_EVAL_PER_TRAIN * cost.forward_s)
        return jnp.log(jnp.stack(out))
