"""Plan search: the space's rules, the relaxation, its gradients, and the search's results.

The relaxed descent compiles once for the whole module (same static settings everywhere); on
this machine that takes up to a minute, the searches themselves a fraction of a second.
"""

import dataclasses
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLUSTER, GPT, LLAMA, MOE
from jax.flatten_util import ravel_pytree

from diffcost import cli, config, default_params
from diffcost import search as S
from diffcost.arrays import cluster_arrays, model_arrays
from diffcost.simulate import STATUS_OK, simulate
from diffcost.space import Choice, make_space

CFG = S.SearchConfig(starts=8, steps=60)
SPACES = {
    "gpt": make_space(GPT, CLUSTER, 32, 128),
    "llama": make_space(LLAMA, CLUSTER, 16, 64),
    "moe": make_space(MOE, CLUSTER, 16, 64),
}


@pytest.fixture(scope="module")
def params():
    return default_params(jnp.float64)


# --- the space ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPACES))
def test_space_rules_agree_with_the_config_checks(name):
    space = SPACES[name]
    choices = space.choices()
    assert len(set(choices)) == len(choices) > 100
    rng = random.Random(0)
    for c in rng.sample(choices, 200):
        assert space.is_valid(c)
        assert config.check_plan(space.model, space.cluster, space.plan_spec(c), space.n_gpus) == []
    # perturbed choices: is_valid is False exactly when they are outside the enumerated set
    members = set(choices)
    for c in rng.sample(choices, 200):
        field = rng.choice(["tp", "pp", "dp", "microbatch", "chunks", "ep"])
        bad = c._replace(**{field: getattr(c, field) * rng.choice([2, 3])})
        assert space.is_valid(bad) == (bad in members)


def test_rank_orders_that_place_ranks_alike_are_one_plan(params):
    space = SPACES["llama"]
    choices = space.choices()
    swapped = [c for c in choices if c.order == 1]
    assert swapped and all(c.dp > 1 and c.pp > 1 for c in swapped)
    # with pp = 1 the orders tp-cp-dp-pp and tp-cp-pp-dp place every rank alike: the same
    # prediction, so the space keeps the first and calls the other invalid
    c = next(c for c in choices if c.pp == 1 and c.dp > 1)
    twin = c._replace(order=1)
    assert twin not in set(choices) and not space.is_valid(twin)
    assert space.canonical(twin) == c
    m, cl = model_arrays(space.model), cluster_arrays(space.cluster)
    plans = jax.tree_util.tree_map(jnp.asarray, space.to_arrays([c, twin]))
    times = jax.vmap(lambda p: simulate(m, p, cl, params).iteration_s)(plans)
    assert float(times[0]) == float(times[1])


def test_no_valid_factorization_is_a_clear_error():
    # tp divides kv_heads=4 and pp the 16 layers: dp >= 256 / (4 * 16) = 4 never divides 3
    with pytest.raises(config.ConfigError, match="no valid plan.*global_batch=3"):
        make_space(LLAMA, CLUSTER, 256, 3, max_cp=1)
    with pytest.raises(config.ConfigError, match="whole nodes"):
        make_space(GPT, CLUSTER, 12, 96)


# --- the relaxation -------------------------------------------------------------------------


def _relaxed_for(space, c: Choice, sharpness=60.0):
    """A RelaxedPlan whose decoded plan is (numerically) the discrete choice ``c``."""
    lg = np.log2([c.tp, c.cp, c.dp, c.pp]) / math.log2(space.n_gpus)
    shares = np.log(np.maximum(lg, 1e-300))
    b = S.bounds_for(space)
    lg_dp = math.log2(c.dp)
    # the same bounds as decode()
    room = min(max(math.log2(space.global_batch) - lg_dp, 0.0), float(b.log2_mb_max))
    experts_lg = min(lg_dp, float(b.log2_experts))

    def logit(frac):
        frac = min(max(frac, 1e-15), 1 - 1e-15)
        return np.asarray(math.log(frac / (1 - frac)))

    def one_hot(i, n):
        return sharpness * (np.eye(n)[i] - 0.5)

    return S.RelaxedPlan(
        shares=shares,
        microbatch=logit(math.log2(c.microbatch) / room if room > 1e-9 else 0.0),
        ep=logit(math.log2(c.ep) / experts_lg if experts_lg > 1e-9 else 0.0),
        chunks=logit(math.log2(c.chunks) / float(b.log2_chunks_max)),
        schedule=one_hot(["gpipe", "1f1b", "interleaved"].index(c.schedule), 3),
        zero=one_hot(c.zero, 4),
        recompute=one_hot(["none", "selective", "full"].index(c.recompute), 3),
        order=one_hot(c.order, len(space.orders)),
    ), b


@pytest.mark.parametrize("name", list(SPACES))
def test_a_sharp_relaxed_plan_predicts_like_its_discrete_plan(name, params):
    """Decoding is consistent with ``Space.to_arrays``: the relaxation contains the space."""
    space = SPACES[name]
    m = model_arrays(space.model, jnp.float64)
    cl = cluster_arrays(space.cluster, jnp.float64)
    rng = random.Random(1)
    for c in rng.sample(space.choices(), 5):
        r, b = _relaxed_for(space, c)
        plan = S.decode(r, b, 1.0)
        exact = jax.tree_util.tree_map(lambda x: x[0], space.to_arrays([c]))
        assert float(plan.n_gpus) == pytest.approx(space.n_gpus, rel=1e-9)
        t_relaxed = float(simulate(m, plan, cl, params).iteration_s)
        t_exact = float(simulate(m, exact, cl, params).iteration_s)
        assert t_relaxed == pytest.approx(t_exact, rel=1e-6), c


def test_degrees_multiply_to_the_gpu_count_for_any_relaxed_plan():
    space = SPACES["gpt"]
    b = S.bounds_for(space)
    starts = S.random_starts(jax.random.PRNGKey(3), 50, len(space.orders))
    for i in range(50):
        r = jax.tree_util.tree_map(lambda x: x[i], starts)
        p = S.decode(r, b, 0.5)
        assert float(p.tp * p.cp * p.dp * p.pp) == pytest.approx(32.0, rel=1e-12)
        assert 1.0 <= float(p.microbatch) <= 16.0 + 1e-9
        for probs in (p.zero, p.recompute, p.schedule):
            assert float(jnp.sum(probs)) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_relaxed_gradient_is_finite_and_matches_finite_differences(seed, params):
    space = SPACES["moe"]
    m = model_arrays(space.model, jnp.float64)
    cl = cluster_arrays(space.cluster, jnp.float64)
    b = S.bounds_for(space)
    r0 = jax.tree_util.tree_map(
        lambda x: x[0], S.random_starts(jax.random.PRNGKey(seed), 1, len(space.orders))
    )
    flat, unravel = ravel_pytree(r0)

    @jax.jit
    def f(x):
        return S.objective(unravel(x), m, cl, params, b, 0.5, 0.1, (10.0, 10.0))

    g = np.asarray(jax.jit(jax.grad(f))(flat))
    assert np.all(np.isfinite(g))
    eps = 1e-6
    for i in range(flat.shape[0]):
        e = np.zeros_like(flat)
        e[i] = eps
        fd = (float(f(flat + e)) - float(f(flat - e))) / (2 * eps)
        assert g[i] == pytest.approx(fd, rel=2e-3, abs=2e-5), (i, g[i], fd)


# --- the search -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPACES))
def test_search_finds_the_exhaustive_optimum(name, params):
    space = SPACES[name]
    result = S.search(space, params, top=3, cfg=CFG)
    everything = S.Evaluator(space, params)(space.choices())
    optimum = min(c.iteration_s for c in everything if c.fits)
    best = result.best[0]
    assert best.fits
    assert best.iteration_s <= optimum * 1.01
    assert result.evaluated < len(everything)
    spec = space.plan_spec(best.choice)
    assert config.check_plan(space.model, space.cluster, spec, space.n_gpus) == []
    times = [c.iteration_s for c in result.best]
    assert times == sorted(times)


def test_nothing_fits_reports_the_smallest_memory(params):
    tiny = dataclasses.replace(CLUSTER, gpu=dataclasses.replace(CLUSTER.gpu, memory_GiB=2.0))
    space = make_space(GPT, tiny, 8, 32)
    result = S.search(space, params, cfg=CFG)
    assert result.best == []
    assert result.closest.status != STATUS_OK
    everything = S.Evaluator(space, params)(space.choices())
    smallest = min(c.memory_peak_bytes for c in everything)
    assert result.closest.memory_peak_bytes <= smallest * 1.05


def test_search_config_rejects_bad_values():
    with pytest.raises(ValueError, match="starts=0"):
        S.SearchConfig(starts=0)
    with pytest.raises(ValueError, match="tau_end"):
        S.SearchConfig(tau_start=0.1, tau_end=0.5)


def test_cli_search_json_and_table(capsys):
    args = ["search", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16"]
    args += ["--global-batch", "64", "--starts", "8", "--steps", "60", "--top", "3"]
    assert cli.main([*args, "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and len(out["top"]) == 3
    assert out["top"][0]["status"] == "ok"
    assert out["top"][0]["n_gpus"] == 16
    assert out["top"][0]["iteration_s"] <= out["top"][1]["iteration_s"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "top 3 plans found" in text and "discrete plans evaluated exactly" in text


def test_cli_search_errors(capsys):
    base = ["search", "gpt3-175b", "--cluster", "selene-a100-80g"]
    assert cli.main([*base, "--gpus", "56", "--global-batch", "1536"]) == 2
    assert "no valid plan" in capsys.readouterr().err
    assert cli.main([*base, "--gpus", "8", "--global-batch", "8", "--top", "0"]) == 2
    assert "--top 0" in capsys.readouterr().err
    code = cli.main([*base, "--gpus", "8", "--global-batch", "8", "--starts", "8", "--steps", "60"])
    out = capsys.readouterr().out
    assert code == 1 and "nothing fits" in out and "smallest peak memory" in out


def test_cli_search_on_a_cluster_without_a_profile_times_plans_as_predict(tmp_path, capsys):
    """selene-a100-80g has no profile of its own: predict takes the median over the
    population's members, and search times, ranks and saves the plans it found the same way
    (the search itself runs at the members' mean constants)."""
    import json

    from diffcost import api

    args = ["search", "llama3-8b", "--cluster", "selene-a100-80g", "--gpus", "16"]
    args += ["--global-batch", "64", "--starts", "8", "--steps", "60", "--top", "3", "--json"]
    assert cli.main([*args, "--save-plans", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "ranked by the median over the population's" in out["profile"]
    times = [t["iteration_s"] for t in out["top"]]
    assert times == sorted(times)
    for t, path in zip(times, out["saved"]):
        assert float(api.predict(path).iteration_s) == pytest.approx(t, rel=1e-6)
