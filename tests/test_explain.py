"""explain: elasticities from one reverse pass equal finite differences of the model itself."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost import api, cli
from diffcost.cache import FAST_CPU_COMPILE
from diffcost.cli.explain import reading
from diffcost.explain import elasticities, explain
from diffcost.params import default_params
from diffcost.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
GPT1B = str(ROOT / "configs" / "examples" / "gpt-1b-vtrain.yaml")
GPT3 = str(ROOT / "configs" / "examples" / "gpt3-175b.yaml")
LLAMA70B = str(ROOT / "configs" / "examples" / "llama3-70b-h100.yaml")
H = 1e-4  # relative perturbation of the finite differences

# elasticity key -> how the config (cluster spec) field that carries it is scaled
CLUSTER_FIELDS = {
    "hbm_Bps": ("gpu", "hbm_bandwidth_GBps"),
    "nvlink_Bps": (None, "nvlink_GBps"),
    "nic_Bps": (None, "nic_Gbps"),
    "nic_latency_s": (None, "nic_latency_us"),
}
# elasticity key -> (raw Params leaf, "log" or "logit")
PARAM_FIELDS = {
    "mem_eff": ("mem_eff_logit", "logit"),
    "kernel_overhead_s": ("kernel_overhead_log_s", "log"),
    "nvlink_eff": ("nvlink_eff_logit", "logit"),
    "half_bw_bytes": ("half_bw_log_bytes", "log"),
}


def _params():
    return default_params(jnp.float64)


# the model itself, compiled with the quick XLA:CPU options that explain uses (same numbers)
_simulate = jax.jit(
    simulate, compiler_options=FAST_CPU_COMPILE if jax.default_backend() == "cpu" else None
)


def _log_time(exp, params):
    return float(np.log(_simulate(*api.experiment_arrays(exp), params).iteration_s))


def _sixteen(cluster):
    """The 16-bit type beside FP8 layers: bf16 where the GPU has it."""
    return "bf16" if cluster.gpu.peak_tflops.get("bf16", 0) > 0 else "fp16"


def _scaled(exp, params, key, factor):
    """(experiment, params) with the quantity behind elasticity ``key`` multiplied by ``factor``."""
    c = exp.cluster
    prec = exp.model.precision
    if key in ("peak_flops", "peak_flops_16bit"):
        # the model's own entry; the 16-bit knob beside fp8 is bf16 (fp16 without bf16)
        names = (_sixteen(c),) if key == "peak_flops_16bit" else (prec,)
        peak = {k: v * factor if k in names else v for k, v in c.gpu.peak_tflops.items()}
        gpu = dataclasses.replace(c.gpu, peak_tflops=peak)
        return dataclasses.replace(exp, cluster=dataclasses.replace(c, gpu=gpu)), params
    if key in CLUSTER_FIELDS:
        sub, field = CLUSTER_FIELDS[key]
        if sub is None:
            c = dataclasses.replace(c, **{field: getattr(c, field) * factor})
        else:
            part = getattr(c, sub)
            part = dataclasses.replace(part, **{field: getattr(part, field) * factor})
            c = dataclasses.replace(c, **{sub: part})
        return dataclasses.replace(exp, cluster=c), params
    if key in ("gemm_eff", "gemm_eff_16bit"):
        from diffcost.specs import PRECISIONS

        names = (_sixteen(c),) if key == "gemm_eff_16bit" else (prec,)
        mask = np.array([p in names for p in PRECISIONS])
        p = np.asarray(params.gemm_eff)
        p = np.where(mask, p * factor, p)
        return exp, params.replace(gemm_eff_logit=jnp.asarray(np.log(p) - np.log1p(-p)))
    raw, kind = PARAM_FIELDS[key]
    r = float(getattr(params, raw))
    if kind == "log":
        r = r + np.log(factor)
    else:
        p = 1.0 / (1.0 + np.exp(-r)) * factor
        r = np.log(p) - np.log1p(-p)
    return exp, params.replace(**{raw: jnp.asarray(r, dtype=jnp.float64)})


def _finite_difference(exp, params, key):
    hi = _log_time(*_scaled(exp, params, key, 1.0 + H))
    lo = _log_time(*_scaled(exp, params, key, 1.0 - H))
    return (hi - lo) / (np.log1p(H) - np.log1p(-H))


CASES = [
    (
        GPT1B,
        (),
        ("peak_flops", "hbm_Bps", "nvlink_Bps", "gemm_eff", "mem_eff", "kernel_overhead_s"),
    ),
    (
        GPT3,
        (),
        ("peak_flops", "nvlink_Bps", "nic_Bps", "nic_latency_s", "nvlink_eff", "half_bw_bytes"),
    ),
    # fp8 GEMMs with 16-bit attention: two separate peaks
    (
        LLAMA70B,
        ("model.precision=fp8",),
        ("peak_flops", "peak_flops_16bit", "gemm_eff", "gemm_eff_16bit"),
    ),
]


@pytest.mark.parametrize("config,overrides,keys", CASES)
def test_elasticities_match_finite_differences(config, overrides, keys):
    exp = api.load(config, overrides)
    params = _params()
    rows = {r["key"]: r for r in elasticities(exp, params)}
    for key in keys:
        fd = _finite_difference(exp, params, key)
        assert rows[key]["elasticity"] == pytest.approx(fd, abs=1e-3), key


@pytest.mark.parametrize("config", [GPT1B, GPT3])
def test_sorted_and_peak_flops_in_range(config):
    rows = elasticities(api.load(config), _params())
    mags = [abs(r["elasticity"]) for r in rows]
    assert all(a >= b - 1e-9 for a, b in zip(mags, mags[1:]))
    by_key = {r["key"]: r for r in rows}
    assert -1.0 < by_key["peak_flops"]["elasticity"] < 0.0
    assert by_key["peak_flops"]["value"] == pytest.approx(312.0)
    assert by_key["peak_flops"]["unit"] == "TFLOP/s"
    assert "peak_flops_16bit" not in by_key  # bf16 model: one 16-bit peak
    assert {"memory_bytes", "gpus_per_node"}.isdisjoint(by_key)
    params = _params()  # every scalar Params constant is reported, plus GEMM efficiency
    n_scalar = sum(np.ndim(getattr(params, f.name)) == 0 for f in dataclasses.fields(params))
    assert sum(r["group"] == "calibration" for r in rows) == n_scalar + 1
    for r in rows:
        assert set(r) >= {"name", "value", "unit", "elasticity"}
        assert np.isfinite(r["elasticity"])


def test_single_gpu_has_no_link_elasticity():
    overrides = ["plan.tp=1", "plan.pp=1", "plan.dp=1", "gpus=1", "plan.global_batch=16"]
    d = explain(api.load(GPT1B, overrides), _params())
    by_key = {r["key"]: r["elasticity"] for r in d["elasticities"]}
    for key in ("nic_Bps", "nvlink_Bps", "nic_eff", "nvlink_eff", "nic_latency_s"):
        assert abs(by_key[key]) < 1e-12, key
    assert by_key["peak_flops"] < 0.0


def test_reading():
    assert reading(-0.62) == "+10% → -5.7% time"
    assert reading(0.0) == "+10% → +0.0% time"
    # 95% cannot grow by a tenth: one percentage point, (1 + 1/95)^-0.14 - 1 = -0.15%
    assert reading(-0.14, 95.0, "%") == "+1 pt → -0.1% time"
    assert reading(-14.0, 95.0, "%") == "+1 pt → -13.6% time"
    assert reading(-0.62, 80.0, "%") == "+10% → -5.7% time"


def test_cli_json_and_table(capsys):
    assert cli.main(["explain", GPT1B, "--json", "--top", "5"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["iteration_s"] > 0 and len(d["elasticities"]) == 5
    exp = api.load(GPT1B)
    params, _ = api.params_for(exp)  # what predict uses (calibrated profile or defaults)
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=np.float64), params)
    assert d["iteration_s"] == pytest.approx(np.exp(_log_time(exp, params)), rel=1e-9)
    assert cli.main(["explain", GPT1B, "cluster.gpu.memory_GiB=2", "--top", "5"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the title wraps with the table's width
    assert "peak FLOP/s" in out and "→" in out and "OUT OF MEMORY" in out


def test_cli_profile_picks_the_constants_like_predict(capsys):
    # gpt-1b-vtrain runs on vtrain-a100, which has a calibrated profile
    assert cli.main(["explain", GPT1B, "--json", "--profile", "none"]) == 0
    none = json.loads(capsys.readouterr().out)
    assert cli.main(["explain", GPT1B, "--json"]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert "datasheet defaults" in none["constants"]
    assert "cluster profile vtrain-a100.yaml" in calibrated["constants"]
    assert none["iteration_s"] != pytest.approx(calibrated["iteration_s"], rel=1e-3)
    params, _ = api.params_for(api.load(GPT1B), "none")
    assert none["iteration_s"] == pytest.approx(explain(GPT1B, params)["iteration_s"], rel=1e-9)
    assert cli.main(["explain", GPT1B, "--top", "0"]) == 2
    assert "--top 0: must be at least 1" in capsys.readouterr().err


def test_explain_on_a_cluster_without_a_profile_is_that_of_the_members_median():
    """On a cluster without a profile of its own ``predict`` times the population's members
    (``diffcost.population``); explain reports the same time, and each elasticity is the
    mean of the members' (the median's log is their mean log time); the note says so. On a
    cluster with a profile it does not."""
    from diffcost import api, profiles
    from diffcost.explain import explain

    config = "configs/examples/gpt3-175b.yaml"
    profileless = explain(config)
    assert "median over the population's" in profileless["constants"]
    exp = api.load(config)
    predicted = api.predict(exp)
    assert profileless["iteration_s"] == pytest.approx(float(predicted.iteration_s), rel=1e-5)
    memory = float(predicted.memory_peak_bytes)
    assert profileless["memory_peak_bytes"] == pytest.approx(memory, rel=1e-6)
    members = profiles.population_members(exp.cluster, stack=exp.stack)
    by_member = [
        {r["key"]: r["elasticity"] for r in explain(config, p)["elasticities"]} for p in members
    ]
    for r in profileless["elasticities"]:
        mean = np.mean([m[r["key"]] for m in by_member])
        assert r["elasticity"] == pytest.approx(mean, rel=1e-4, abs=1e-6)
    spread = np.ptp([m["gemm_eff"] for m in by_member])
    assert spread > 1e-4  # the members differ, so the mean is not any one of them
    profiled = explain("configs/examples/llama3-70b-h100.yaml")  # dgx-h100 has a profile
    assert "median over" not in profiled["constants"]
