"""Design and plan together: alternate ``diffcost search`` and ``diffcost design``.

The best network depends on the plan and the best plan on the network. ``alternate`` starts
from the design of the file's own plan and then, each round,

1. searches the best plan (``diffcost.search.optimize``) on the experiment's cluster adjusted
   to the current design (``searched_cluster``): NVLink and NIC bandwidth times their classes'
   multipliers, the fabric's oversubscription the topology's leaf taper at that design (down
   over up capacity, at least 1). The search ranks plans with the cost model's own
   communication, which sees the network only through these three numbers;
2. designs the network for that plan on the graph (``design.optimize``, from the built
   network, through the job-time seam);

and stops when the search returns the plan it had, or after ``rounds`` rounds. Each round is
reported; the best (plan, design) pair is the one with the lowest objective.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diffcost import search
from diffcost.network import job as netjob
from diffcost.network.design import optimize
from diffcost.network.design_config import DesignSpec, design_params, oversubscription
from diffcost.specs import ClusterSpec, PlanSpec

PLAN_KEYS = ("tp", "cp", "pp", "dp", "ep", "zero", "recompute", "microbatch", "schedule")


def searched_cluster(cluster: ClusterSpec, topology, scale) -> ClusterSpec:
    """``cluster`` as the cost model's search should see the design ``scale [CLASSES]``."""
    s = dict(zip(netjob.CLASSES, np.asarray(scale, dtype=float)))
    taper = oversubscription(topology, scale).get("leaf", cluster.oversubscription)
    return dataclasses.replace(
        cluster,
        nvlink_GBps=cluster.nvlink_GBps * s["nvlink"],
        nic_Gbps=cluster.nic_Gbps * s["nic"],
        oversubscription=max(1.0, float(taper)),
    )


def plan_summary(plan: PlanSpec) -> dict:
    """The plan's degrees and choices, for reports."""
    out = {k: getattr(plan, k) for k in PLAN_KEYS}
    return {**out, "chunks": plan.chunks, "order": list(plan.order)}


def _design_for(spec: DesignSpec, plan: PlanSpec, time_fn) -> dict:
    exp = dataclasses.replace(spec.experiment, plan=plan)
    params, time_fn = design_params(exp, time_fn)
    job = netjob.experiment_job(spec.topology, exp)
    start, best, _ = optimize(
        job, params, spec.spend, spec.objective, spec.steps, spec.learning_rate, time_fn
    )
    return {
        "plan": plan_summary(plan),
        "start_time_s": start.time_s,
        "best_time_s": best.time_s,
        "best_cost_usd": best.cost_usd,
        "best_objective": best.objective,
        "best_scale": best.scale.tolist(),
    }


def alternate(
    spec: DesignSpec,
    rounds: int = 3,
    config: search.SearchConfig | None = None,
    time_fn=None,
) -> list[dict]:
    """Rounds of (search the plan at the current design, design the network for it).

    Args:
        spec: ``design_config.load_design(...)``; its plan is round 0's.
        rounds: search rounds after round 0.
        config: the search's knobs.
        time_fn: the job-time seam (None: ``job.default_time_fn()``).

    Returns:
        One dict per round: ``{"plan", "start_time_s", "best_time_s", "best_cost_usd",
        "best_objective", "best_scale"}`` (+ ``"searched_s"``, the search's own prediction on
        the adjusted cluster, from round 1).
    """
    exp = spec.experiment
    out = [_design_for(spec, exp.plan, time_fn)]
    plan = exp.plan
    for _ in range(rounds):
        cluster = searched_cluster(exp.cluster, spec.topology, out[-1]["best_scale"])
        found = search.optimize(
            exp.model, cluster, plan.n_gpus, plan.global_batch, top=1, config=config
        )
        if not found.best:
            break
        new = found.space.plan_spec(found.best[0].choice)
        if new == plan:
            break
        plan = new
        out.append({**_design_for(spec, plan, time_fn), "searched_s": found.best[0].iteration_s})
    return out
