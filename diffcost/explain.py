"""Which knob matters: the elasticity of iteration time to every hardware and calibrated constant.

For each parameter ``x`` the elasticity is ``d ln T / d ln x``: the percent change of the
predicted iteration time ``T`` per percent change of ``x`` (``-1`` for a fully compute-bound
run's peak FLOP/s, ``0`` for a knob that does not touch the critical path). All of them come
exactly out of one reverse pass (``jax.grad``) through ``diffcost.simulate``.

Every knob is written as a log-scale perturbation ``u`` of the value the model uses, so the
elasticity is ``d ln T / d u`` at ``u = 0``:

* cluster facts: ``x -> x * exp(u)``;
* log-stored ``Params`` (``x = exp(raw)``): ``raw -> raw + u``;
* logit-stored fractions (``p = sigmoid(raw)``): ``raw -> raw + u / (1 - p)``, which moves
  ``ln p`` by ``u`` to first order, i.e. ``d ln T / d ln p = (d T / d raw) / T / (1 - p)``.

Peak FLOP/s and GEMM efficiency have one entry per precision. The GEMMs run at the model's
precision. Attention (and an FP8 run's LM head) runs at the model's own entry when that is
bf16 or fp16; beside fp8/fp4/fp32 layers at bf16, or fp16 on a GPU without bf16
(``kernels.half_peak_flops``), which is then a separate 16-bit knob. Memory capacity and GPUs
per node are not speed knobs and are left out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import population, profiles, smooth
from diffcost.cache import fast_compile_jit
from diffcost.params import BY_LEAF, CONSTANTS, Params
from diffcost.simulate import STATUS_NAMES, simulate
from diffcost.specs import PRECISIONS, Experiment

_BF16, _FP16 = PRECISIONS.index("bf16"), PRECISIONS.index("fp16")
_HARDWARE, _CALIBRATION = "hardware", "calibration"

# (ClusterArrays field in SI units, name, unit shown, factor from SI to that unit)
_CLUSTER_KNOBS = (
    ("hbm_Bps", "HBM bandwidth", "GB/s", 1e-9),
    ("nvlink_Bps", "NVLink bandwidth (one way)", "GB/s", 1e-9),
    ("nic_Bps", "NIC bandwidth per GPU", "Gbit/s", 8e-9),
    ("nvlink_latency_s", "NVLink latency", "µs", 1e6),
    ("nic_latency_s", "NIC latency", "µs", 1e6),
    ("oversubscription", "fabric oversubscription", "x", 1.0),
)


def _param_knobs() -> tuple[tuple[str, str, str], ...]:
    """(raw leaf, constant name, "log" or "logit") of every scalar calibrated constant (every
    entry of ``diffcost.params.CONSTANTS`` with a scalar leaf, so a constant added there shows
    up here with its label)."""
    return tuple((c.leaf, c.name, c.transform) for c in CONSTANTS if c.shape == ())


# Vector knobs (per precision): 0 model-precision peak, 1 16-bit peak, 2 and 3 the same for
# GEMM efficiency; one pair of masks (``_precision_groups``) selects the entries they scale.
_N_VECTOR = 4


def _precision_groups(peak: np.ndarray, prec: int) -> tuple[np.ndarray, np.ndarray]:
    """Masks of the entries moved by the model-precision knob and by the 16-bit knob.

    The same masks serve peak FLOP/s and GEMM efficiency. A bf16 or fp16 model has no
    separate 16-bit knob (its attention runs at its own entry); beside fp8/fp4/fp32 layers the
    16-bit knob is bf16, or fp16 where the GPU has no bf16 (none if it has neither).
    """
    a = np.zeros(len(PRECISIONS))
    a[prec] = 1.0
    b = np.zeros(len(PRECISIONS))
    if prec not in (_BF16, _FP16):
        half = _BF16 if peak[_BF16] > 0 else _FP16
        b[half] = 1.0 if peak[half] > 0 else 0.0
    return a, b


def _perturb(u, cluster, params: Params, masks, knobs):
    """Cluster and params moved by the log-scale knobs ``u`` (identity at ``u = 0``).

    ``u``: the 4 vector knobs, then ``_CLUSTER_KNOBS``, then the Params ``knobs``.
    """
    m_prec, m_16 = masks
    n_c = len(_CLUSTER_KNOBS)
    cu, pu = u[_N_VECTOR : _N_VECTOR + n_c], u[_N_VECTOR + n_c :]
    peak = cluster.peak_flops * jnp.exp(u[0] * m_prec + u[1] * m_16)
    cluster = cluster.replace(
        peak_flops=peak,
        **{
            key: getattr(cluster, key) * jnp.exp(cu[i])
            for i, (key, *_) in enumerate(_CLUSTER_KNOBS)
        },
    )
    eff_raw = params.gemm_eff_logit
    eff_raw = eff_raw + (u[2] * m_prec + u[3] * m_16) / (1.0 - params.gemm_eff)
    changes = {"gemm_eff_logit": eff_raw}
    for i, (raw, _, kind) in enumerate(knobs):
        r = getattr(params, raw)
        changes[raw] = r + (pu[i] if kind == "log" else pu[i] / (1.0 - jax.nn.sigmoid(r)))
    return cluster, params.replace(**changes)


def _log_time_and_grad(u, model, plan, cluster, params, masks, knobs, temperature):
    """The prediction and ``d ln T / d u``: one forward and one reverse pass."""

    def log_time(u):
        c, p = _perturb(u, cluster, params, masks, knobs)
        out = simulate(model, plan, c, p, temperature)
        return jnp.log(out.iteration_s), out

    (_, out), grad = jax.value_and_grad(log_time, has_aux=True)(u)
    return out, grad


# The program runs once per member, so its speed does not matter: compile it the fast way.
_run = fast_compile_jit(_log_time_and_grad, static_argnames=("knobs", "temperature"))


def _median_time_and_grad(u, model, plan, cluster, members, masks, knobs, temperature):
    """(the members' ``Breakdown`` combined as ``predict`` combines them,
    ``population.median_breakdown``, ``d ln median / d u``): the median's log is the members'
    mean log time, so its gradient is the mean of theirs; one member gives its own."""
    outs, grads = [], []
    dtype = np.asarray(u).dtype
    for p in members:
        p = jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=dtype), p)
        out, grad = _run(u, model, plan, cluster, p, masks, knobs=knobs, temperature=temperature)
        outs.append(jax.tree_util.tree_map(np.asarray, out))
        grads.append(np.asarray(grad, dtype=float))
    if len(outs) == 1:
        return outs[0], grads[0]
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *outs)
    return population.median_breakdown(stacked), np.mean(grads, axis=0)


def explain(
    exp: Experiment,
    params: Params | None = None,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
    profile=None,
    topology=None,
) -> dict:
    """Prediction summary and elasticities of one experiment (the ``explain --json`` object).

    Returns:
        ``{"iteration_s", "status", "memory_peak_bytes", "memory_capacity_bytes",
        "memory_headroom_bytes", "constants", "elasticities"}``; ``elasticities`` as in
        ``elasticities``, ``constants`` says which Params were used. ``profile`` picks the
        constants when ``params`` is None, as ``predict --profile`` does
        (``diffcost.api.params_for``: None for the cluster's calibrated profile, ``"none"``
        for datasheet defaults, or a profile file). With a ``topology`` (a
        ``network.graph.Topology``) the result also has ``link_classes``
        (``link_class_elasticities``) and ``graph_iteration_s``.
    """
    from diffcost.api import experiment_arrays, load, params_for

    exp = load(exp)
    note, members = "given Params", []
    if params is None:
        params, note = params_for(exp, profile)
        members = profiles.population_members(exp.cluster, profile, stack=exp.stack)
        if members:  # predict's time is their median (diffcost.population)
            note += (
                f"; time and elasticities of the median over the population's {len(members)} "
                "members (values: their mean constants)"
            )
    model, plan, cluster = experiment_arrays(exp)
    dtype = np.asarray(cluster.hbm_Bps).dtype
    # one dtype, no weak types: every call hits the same compiled program
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=dtype), params)
    prec = PRECISIONS.index(exp.model.precision)
    peak = np.asarray(cluster.peak_flops, dtype=float)
    eff = np.asarray(params.gemm_eff, dtype=float)
    m_prec, m_16 = _precision_groups(peak, prec)
    masks = tuple(np.asarray(m, dtype=dtype) for m in (m_prec, m_16))
    knobs = _param_knobs()
    u = np.zeros(_N_VECTOR + len(_CLUSTER_KNOBS) + len(knobs), dtype=dtype)
    out, grad = _median_time_and_grad(
        u, model, plan, cluster, members or [params], masks, knobs, temperature
    )

    prec_name = exp.model.precision
    rows = []

    def row(key, group, name, value, unit, e):
        r = dict(key=key, group=group, name=name, value=_round(value), unit=unit)
        rows.append({**r, "elasticity": float(e)})

    tflops = 1e-12 * peak
    row("peak_flops", _HARDWARE, f"peak FLOP/s ({prec_name})", tflops[prec], "TFLOP/s", grad[0])
    half = np.flatnonzero(m_16)  # the one 16-bit entry beside fp8/fp4/fp32 layers, or none
    if half.size:
        v16 = tflops[half[0]]
        row("peak_flops_16bit", _HARDWARE, "peak FLOP/s (16-bit)", v16, "TFLOP/s", grad[1])
    row("gemm_eff", _CALIBRATION, f"GEMM efficiency ({prec_name})", 100 * eff[prec], "%", grad[2])
    if half.size:
        v16 = 100.0 * eff[half[0]]
        row("gemm_eff_16bit", _CALIBRATION, "GEMM efficiency (16-bit)", v16, "%", grad[3])
    for i, (key, name, unit, scale) in enumerate(_CLUSTER_KNOBS):
        if cluster.network is not None and key != "hbm_Bps":
            continue  # on a graph the links' capacities and latencies are the topology's
        value = float(np.asarray(getattr(cluster, key))) * scale
        row(key, _HARDWARE, name, value, unit, grad[_N_VECTOR + i])
    if cluster.network is not None:  # a topology graph: one knob per link class
        capacity = np.asarray(cluster.network.tier_capacity_Bps, dtype=float)
        tiers = tier_elasticities(model, plan, cluster, params, temperature)
        for (tier, e), value in zip(tiers.items(), capacity):
            row(f"link_{tier}", _HARDWARE, f"{tier} link capacity", 1e-9 * value, "GB/s", e)
    for i, (raw, key, kind) in enumerate(knobs):
        name, unit, scale = BY_LEAF[raw].label, BY_LEAF[raw].unit, BY_LEAF[raw].scale
        r = float(np.asarray(getattr(params, raw)))
        value = (np.exp(r) if kind == "log" else 1.0 / (1.0 + np.exp(-r))) * scale
        row(key, _CALIBRATION, name, value, unit, grad[_N_VECTOR + len(_CLUSTER_KNOBS) + i])
    # largest magnitude first; knobs that enter only as a product (peak x efficiency) tie: the
    # hardware one first
    rows.sort(key=lambda r: (-round(abs(r["elasticity"]), 6), r["group"] != _HARDWARE))

    f = lambda x: float(np.asarray(x))  # noqa: E731
    network = {} if topology is None else _network(exp, topology, params, members, temperature)
    return {
        **network,
        "iteration_s": f(out.iteration_s),
        "status": STATUS_NAMES[int(out.status)],
        "memory_peak_bytes": f(out.memory_peak_bytes),
        "memory_capacity_bytes": f(out.memory_capacity_bytes),
        "memory_headroom_bytes": f(out.memory_capacity_bytes) - f(out.memory_peak_bytes),
        "constants": note,
        "elasticities": rows,
    }


def _network(exp, topology, params, members, temperature) -> dict:
    """``explain``'s ``graph_iteration_s`` and ``link_classes`` on ``topology``: at ``params``,
    or the members' median when there are any (its own elasticities, as for the constants)."""
    args = (params, temperature)
    if members:
        from diffcost.network.job import median_time_fn

        args = (population.stack_members(members), temperature, median_time_fn())
    graph_s, classes = link_class_elasticities(exp, topology, *args)
    return {"graph_iteration_s": graph_s, "link_classes": classes}


def tier_elasticities(model, plan, cluster, params, temperature=smooth.DEFAULT_TEMPERATURE):
    """``{tier: d ln T / d ln capacity}`` for each link class of the cluster's topology graph
    (``cluster.network``, ``diffcost.network.tables.TIERS``): every link of the class scaled
    together, one reverse pass."""
    tables = cluster.network
    capacity = jnp.asarray(tables.tier_capacity_Bps)

    def log_time(u):
        scaled = cluster.replace(network=tables.with_capacities(capacity * jnp.exp(u)))
        return jnp.log(simulate(model, plan, scaled, params, temperature).iteration_s)

    grad = jax.grad(log_time)(jnp.zeros_like(capacity))
    return {tier: float(g) for tier, g in zip(tables.tiers, np.asarray(grad))}


def elasticities(
    exp: Experiment,
    params: Params | None = None,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
) -> list[dict]:
    """Elasticity ``d ln T / d ln x`` of the iteration time to every speed knob.

    Args:
        exp: an ``Experiment`` or a config path (``diffcost.api.load``).
        params: calibrated constants (default: those ``diffcost predict`` uses, i.e. the
            cluster's calibrated profile where there is one, else ``default_params()``).
        temperature: smoothness of the model, as in ``simulate``.

    Returns:
        Dicts ``{"key", "group", "name", "value", "unit", "elasticity"}``, largest
        ``|elasticity|`` first. ``value`` is in ``unit`` (human units: TFLOP/s, GB/s, us, %);
        ``group`` is ``"hardware"`` (the cluster) or ``"calibration"`` (``Params``).

    Examples:
        >>> rows = elasticities("configs/examples/gpt-1b-vtrain.yaml")
        >>> -1.0 <= next(r for r in rows if r["key"] == "peak_flops")["elasticity"] <= 0.0
        True
    """
    return explain(exp, params, temperature)["elasticities"]


def link_class_elasticities(
    exp: Experiment,
    topology,
    params: Params,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
    time_fn=None,
) -> tuple[float, list[dict]]:
    """Elasticity of the iteration time to the capacity of each link class of a topology.

    The iteration time comes through the job-time seam (``diffcost.network.job``; default
    ``graph_iteration_s``: the model with its collectives priced on the graph), every link of a
    class (``job.CLASSES``: NVLink, NIC, leaf-spine, spine-core) scaled together.

    Args:
        exp: the experiment (its discrete plan is placed on the topology, rank r on GPU r).
        topology: a ``network.graph.Topology`` with at least the plan's GPUs.
        params: calibrated constants.
        temperature: as in ``simulate``.
        time_fn: a ``job.JobTimeFn`` (None: ``job.default_time_fn()``).

    Returns:
        (graph iteration seconds, rows ``{"key", "name", "links", "capacity_GBps",
        "elasticity"}`` of the classes the topology has, largest ``|elasticity|`` first;
        ``links`` directed links, ``capacity_GBps`` their total capacity).
    """
    from diffcost.network import design, job

    netjob = job.experiment_job(topology, exp)
    ones = np.ones(len(job.CLASSES))
    m = design.marginals(ones, netjob, params, np.zeros_like(ones), time_fn, temperature)
    classes = job.link_classes(topology)
    rows = [
        {
            "key": name,
            "name": NETWORK_LABELS[name],
            "links": int((classes == i).sum()),
            "capacity_GBps": _round(topology.capacity_Bps[classes == i].sum() * 1e-9),
            "elasticity": float(m["elasticity"][i]),
        }
        for i, name in enumerate(job.CLASSES)
        if (classes == i).any()
    ]
    rows.sort(key=lambda r: -abs(r["elasticity"]))
    return m["time_s"], rows


NETWORK_LABELS = {
    "nvlink": "NVLink links (GPU-NVSwitch, GPU-GPU)",
    "nic": "NIC links (GPU-NIC, NIC-leaf)",
    "leaf_spine": "leaf-spine links",
    "spine_core": "spine-core links",
}


def _round(value) -> float:
    """A human value to 6 significant digits (no float32 noise such as 80.0000012)."""
    return float(f"{float(value):.6g}")
