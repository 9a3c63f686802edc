"""Strict YAML for ``diffcost design`` (``configs/designs/*.yaml``).

A design file names a job, the network it runs on, what its links cost and what to minimize::

    description: Llama 3 8B, FSDP over 128 H100 on a 2:1 tapered leaf/spine
    experiment: ../examples/llama3-8b-fsdp.yaml   # a file (relative to this one) or a name
    overrides: [gpus=128, plan.dp=128]           # key=value, as on the command line
    topology: leaf-spine-2to1                    # a preset or a file; default: the cluster's
    prices:                                      # per link class; a class in one form
      nvlink: {usd_per_GBps: 40}                 # per GB/s of a cable, one direction
      nic: {usd_per_link: 1800}                  # per physical cable as built
      leaf_spine: {usd_per_link: 1200}
    objective: {minimize: time, budget_usd: 2.0e6}   # or {minimize: cost_time, fixed_usd: ...}
    optimize: [nic, leaf_spine]                  # default: every priced class
    steps: 150
    learning_rate: 0.05

Every error names the file, the dotted field, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from diffcost import config
from diffcost.network import generators as gen
from diffcost.network import job as netjob
from diffcost.network.design import OBJECTIVES, Design, Objective, Prices, marginals, optimize
from diffcost.network.graph import Topology
from diffcost.network.load import load_topology
from diffcost.spec_values import ConfigError, invalid
from diffcost.specs import Experiment

KEYS = (
    "description",
    "experiment",
    "overrides",
    "topology",
    "prices",
    "objective",
    "optimize",
    "steps",
    "learning_rate",
)
PRICE_KEYS = ("usd_per_GBps", "usd_per_link")
OBJECTIVE_KEYS = {"time": ("minimize", "budget_usd"), "cost_time": ("minimize", "fixed_usd")}


@dataclasses.dataclass(frozen=True)
class DesignSpec:
    """A loaded design file: the job, its topology, the class spends and the objective."""

    where: str
    experiment: Experiment
    topology: Topology
    prices: Prices
    spend: np.ndarray
    objective: Objective
    steps: int
    learning_rate: float


def _unknown(key, valid, where, path) -> ConfigError:
    close = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "valid: " + ", ".join(valid)
    return ConfigError(f"unknown key '{path}{key}' in {where}; {hint}")


def _number(value, where, path, lo=0.0):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > lo:
        raise invalid(where, path, value, f"a number > {lo:g}")
    return float(value)


def _mapping(tree, key, where):
    value = tree.get(key)
    if not isinstance(value, Mapping):
        raise invalid(where, key, value, "a mapping")
    return value


def _prices(tree, where, present) -> tuple[dict, dict]:
    """``(usd_per_GBps, usd_per_link)`` by class from ``prices``."""
    per_gbps, per_link = {}, {}
    for name, entry in _mapping(tree, "prices", where).items():
        path = f"prices.{name}"
        if name not in netjob.CLASSES:
            raise invalid(where, "prices", name, f"link classes among {', '.join(netjob.CLASSES)}")
        if name not in present:
            raise invalid(where, path, entry, f"a class of the topology ({', '.join(present)})")
        if not isinstance(entry, Mapping) or len(entry) != 1:
            raise invalid(where, path, entry, "a mapping with one of usd_per_GBps, usd_per_link")
        key, value = next(iter(entry.items()))
        if key not in PRICE_KEYS:
            raise _unknown(key, PRICE_KEYS, where, f"{path}.")
        target = per_gbps if key == "usd_per_GBps" else per_link
        target[name] = _number(value, where, f"{path}.{key}")
    if not per_gbps and not per_link:
        raise invalid(where, "prices", {}, "at least one priced link class")
    return per_gbps, per_link


def _optimize(tree, where, priced) -> tuple:
    names = tree.get("optimize", list(priced))
    if not isinstance(names, list) or not names:
        raise invalid(where, "optimize", names, f"a non-empty list of priced classes {priced}")
    for i, name in enumerate(names):
        if name not in priced:
            raise invalid(where, f"optimize[{i}]", name, f"a priced class ({', '.join(priced)})")
    return tuple(1.0 if c in names else 0.0 for c in netjob.CLASSES)


def _objective(tree, where, spend, optimize) -> Objective:
    obj = _mapping(tree, "objective", where)
    kind = obj.get("minimize")
    if kind not in OBJECTIVES:
        raise invalid(where, "objective.minimize", kind, f"one of {', '.join(OBJECTIVES)}")
    for key in obj:
        if key not in OBJECTIVE_KEYS[kind]:
            raise _unknown(key, OBJECTIVE_KEYS[kind], where, "objective.")
    need = OBJECTIVE_KEYS[kind][1]
    if need not in obj:
        raise ConfigError(f"{where}: objective.{need} is missing (minimize: {kind} needs it)")
    value = _number(obj[need], where, f"objective.{need}")
    if kind == "cost_time":
        return Objective(kind, optimize, fixed_usd=value)
    fixed = float(np.dot(spend, 1.0 - np.asarray(optimize)))
    if value <= fixed:
        raise invalid(
            where, "objective.budget_usd", obj[need], f"more than {fixed:.6g}, the classes kept"
        )
    return Objective(kind, optimize, budget_usd=value)


def _resolve(value, directory: Path) -> str:
    """A file named relative to the design file, else the name as given (a preset)."""
    if isinstance(value, str) and ("/" in value or value.endswith((".yaml", ".yml"))):
        candidate = directory / value
        return str(candidate) if candidate.is_file() else value
    return value


def _experiment(tree, where, directory) -> Experiment:
    value, overrides = tree.get("experiment"), tree.get("overrides", [])
    if not isinstance(value, str):
        raise invalid(where, "experiment", value, "an experiment file or example name")
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise invalid(where, "overrides", overrides, "a list of key=value strings")
    try:
        return config.load_experiment(_resolve(value, directory), overrides)
    except ConfigError as err:
        raise ConfigError(f"{where}: experiment: {err}") from None


def _topology(tree, where, directory, exp: Experiment) -> Topology:
    value = tree.get("topology")
    if value is None:
        nodes = -(-exp.plan.n_gpus // exp.cluster.gpus_per_node)
        return gen.from_cluster(exp.cluster, nodes)
    if not isinstance(value, str):
        raise invalid(where, "topology", value, "a topology preset or file")
    try:
        topology = load_topology(_resolve(value, directory))
    except ConfigError as err:
        raise ConfigError(f"{where}: topology: {err}") from None
    if len(topology.endpoints) < exp.plan.n_gpus:
        raise invalid(
            where, "topology", value, f"a topology of at least {exp.plan.n_gpus} GPUs (the plan's)"
        )
    return topology


def _positive(tree, key, default, where, integer=False):
    value = tree.get(key, default)
    if integer and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise invalid(where, key, value, "a positive integer")
    return value if integer else _number(value, where, key)


def load_design(path) -> DesignSpec:
    """Load and check a design file.

    Raises:
        ConfigError: naming the file, the field, the value and what is valid.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"design file not found: {file}")
    tree, where = config.read_yaml(file)
    for key in tree:
        if key not in KEYS:
            raise _unknown(key, KEYS, where, "")
    exp = _experiment(tree, where, file.resolve().parent)
    topology = _topology(tree, where, file.resolve().parent, exp)
    classes = netjob.link_classes(topology)
    present = [c for i, c in enumerate(netjob.CLASSES) if (classes == i).any()]
    per_gbps, per_link = _prices(tree, where, present)
    prices = Prices.per_class(topology, per_gbps, per_link)
    spend = prices.class_spend(topology)
    optimize = _optimize(tree, where, [c for c in netjob.CLASSES if c in per_gbps or c in per_link])
    return DesignSpec(
        where=where,
        experiment=exp,
        topology=topology,
        prices=prices,
        spend=spend,
        objective=_objective(tree, where, spend, optimize),
        steps=_positive(tree, "steps", 150, where, integer=True),
        learning_rate=_positive(tree, "learning_rate", 0.05, where),
    )


def oversubscription(topology: Topology, scale) -> dict:
    """Per switch tier (leaf, spine) with links up: capacity down over capacity up, at the
    class multipliers ``scale [CLASSES]`` (``{"leaf": 2.0}`` for a 2:1 taper)."""
    kinds = np.array(topology.kinds)
    capacity = topology.capacity_Bps * np.asarray(scale)[netjob.link_classes(topology)]
    tier = np.array([netjob.KIND_TIER[k] for k in kinds])
    out = {}
    for kind in ("leaf", "spine"):
        leaving = kinds[topology.src] == kind
        up = leaving & (tier[topology.dst] > netjob.KIND_TIER[kind])
        up &= kinds[topology.dst] != kind
        down = leaving & ~up & (kinds[topology.dst] != kind)
        if up.any() and down.any():
            out[kind] = float(capacity[down].sum() / capacity[up].sum())
    return out


def _point(d: Design, spec: DesignSpec, job, params, time_fn=None) -> dict:
    m = marginals(d.scale, job, params, spec.spend, time_fn)
    return {
        "scale": d.scale.tolist(),
        "time_s": d.time_s,
        "cost_usd": d.cost_usd,
        "objective": d.objective,
        "elasticity": m["elasticity"].tolist(),
        "s_saved_per_usd": [None if np.isnan(x) else float(x) for x in m["s_saved_per_usd"]],
        "oversubscription": oversubscription(spec.topology, d.scale),
    }


def design_params(exp: Experiment, time_fn=None):
    """(params, time_fn) that time ``exp``'s job as ``diffcost predict`` times ``exp``: the
    cluster's constants, or for a cluster that takes the population's median
    (``population.constants_for``) the members with a leading axis and
    ``job.median_time_fn(time_fn)``."""
    from diffcost import population

    params, members, _ = population.constants_for(exp.cluster, stack=exp.stack)
    if members is not None:
        return members, netjob.median_time_fn(time_fn)
    return params, time_fn


def run_design(spec: DesignSpec, params=None, time_fn=None) -> dict:
    """Optimize ``spec`` and report the built network and the best design.

    Args:
        spec: ``load_design(...)``.
        params: calibrated constants (default: the experiment's, as ``diffcost predict``,
            ``design_params``; given, they and ``time_fn`` are used as they are).
        time_fn: the job-time seam (None: ``job.default_time_fn()``).

    Returns:
        ``{"design", "experiment", "topology", "objective", "budget_usd", "fixed_usd",
        "classes", "spend_usd", "predict_iteration_s", "start", "best", "steps"}``; ``start``
        and ``best`` each ``{"scale", "time_s", "cost_usd", "objective", "elasticity",
        "s_saved_per_usd", "oversubscription"}`` (per class lists in ``classes``' order).
    """
    from diffcost import api

    exp = spec.experiment
    given = params
    if params is None:
        params, time_fn = design_params(exp, time_fn)
    try:
        job = netjob.experiment_job(spec.topology, exp)
    except ValueError as err:
        raise ConfigError(f"{spec.where}: the plan on the topology: {err}") from None
    start, best, history = optimize(
        job, params, spec.spend, spec.objective, spec.steps, spec.learning_rate, time_fn
    )
    return {
        "design": spec.where,
        "experiment": exp.source,
        "topology": spec.topology.name,
        "objective": spec.objective.kind,
        "budget_usd": spec.objective.budget_usd,
        "fixed_usd": spec.objective.fixed_usd,
        "classes": list(netjob.CLASSES),
        "optimized": [c for c, m in zip(netjob.CLASSES, spec.objective.optimize) if m],
        "spend_usd": spec.spend.tolist(),
        "predict_iteration_s": float(api.predict(exp, params=given).iteration_s),
        "start": _point(start, spec, job, params, time_fn),
        "best": _point(best, spec, job, params, time_fn),
        "steps": len(history) - 1,
    }
