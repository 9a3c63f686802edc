"""The plan rules: one table, and its four consumers agree on every plan.

The consumers are ``config.check_plan`` (messages), ``simulate.plan_is_valid`` (traced mask),
``space.Space`` (enumeration) and ``search.objective`` (``constraints.relaxed_penalties``).
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLUSTER, LLAMA, MOE
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from diffcost import config, constraints
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays
from diffcost.constraints import EXACT, RULES, TRACED
from diffcost.simulate import plan_is_valid
from diffcost.space import Choice, Space, make_space
from diffcost.specs import PLACED_DIMS, SCHEDULES, ModelSpec, MoeSpec, PlanSpec

PENALTY_TOL = 1e-12  # a satisfied rule's relaxed penalty at a discrete plan (float64)
DEGREES = st.sampled_from([1, 2, 3, 4, 6, 8, 16])


def _model(heads, kv_groups, n_layers, seq_len, experts) -> ModelSpec:
    moe = MoeSpec(experts=experts, top_k=1) if experts > 1 else None
    return dataclasses.replace(
        MOE if moe else LLAMA,
        heads=heads,
        kv_heads=heads // kv_groups,
        n_layers=n_layers,
        seq_len=seq_len,
        moe=moe,
    )


MODELS = st.builds(
    _model,
    heads=st.sampled_from([4, 6, 8, 12, 16, 24]),
    kv_groups=st.sampled_from([1, 2]),
    n_layers=st.sampled_from([6, 8, 12, 16, 24, 30]),
    seq_len=st.sampled_from([256, 384, 1000, 1024, 2048]),
    experts=st.sampled_from([1, 4, 6, 8]),
)


@st.composite
def plans(draw) -> PlanSpec:
    schedule = draw(st.sampled_from(SCHEDULES))
    return PlanSpec(
        tp=draw(DEGREES),
        cp=draw(DEGREES),
        dp=draw(DEGREES),
        pp=draw(DEGREES),
        ep=draw(st.sampled_from([1, 2, 4])),
        microbatch=draw(st.sampled_from([1, 2, 4])),
        global_batch=draw(st.sampled_from([4, 8, 12, 16, 31, 32, 48, 64, 96])),
        schedule=schedule,
        chunks=draw(st.sampled_from([2, 3, 4])) if schedule == "interleaved" else 1,
    )


@jax.jit
def _traced(model, plan, cluster):
    """(plan_is_valid, each rule's traced test, relaxed penalties) of one plan's arrays."""
    q = constraints.array_quantities(model, plan, cluster)
    per_rule = jnp.stack([r.test(q, TRACED) for r in RULES])
    return plan_is_valid(model, plan, cluster), per_rule, q


def _arrays(model, plan, cluster=CLUSTER):
    return model_arrays(model), plan_arrays(plan), cluster_arrays(cluster)


# --- the four consumers agree -------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(MODELS, plans())
def test_config_check_and_traced_mask_agree_rule_by_rule(model, plan):
    valid, per_rule, _ = _traced(*_arrays(model, plan))
    q = constraints.spec_quantities(model, CLUSTER, plan)
    exact = [bool(r.test(q, EXACT)) for r in RULES]
    assert list(np.asarray(per_rule)) == exact
    problems = config.check_plan(model, CLUSTER, plan)
    assert (problems == []) == all(exact)
    masked = [ok for r, ok in zip(RULES, exact) if r.name not in constraints.MASK_SKIPS]
    assert bool(valid) == all(masked)
    # a message for every broken rule unless a rule it requires is broken too
    broken = {r.name for r, ok in zip(RULES, exact) if not ok}
    shown = [r for r in RULES if r.name in broken and not broken.intersection(r.requires)]
    assert len(problems) == len(shown)


@settings(max_examples=200, deadline=None)
@given(MODELS, plans())
def test_lenient_check_skips_exactly_the_strict_rules(model, plan):
    q = constraints.spec_quantities(model, CLUSTER, plan)
    lenient = config.check_plan(model, CLUSTER, plan, strict=False)
    broken = [r for r in RULES if not r.strict and not r.test(q, EXACT)]
    names = {r.name for r in broken}
    assert len(lenient) == len([r for r in broken if not names.intersection(r.requires)])


@settings(max_examples=200, deadline=None)
@given(MODELS, plans(), st.sampled_from([0, 1]))
def test_space_agrees_with_the_config_check(model, plan, order):
    """A choice in the space's menus is valid for the space exactly when check_plan passes."""
    n_gpus = plan.n_gpus
    space = Space(model, CLUSTER, n_gpus, plan.global_batch, max_cp=16)
    choice = Choice(
        *(getattr(plan, d) for d in PLACED_DIMS),
        plan.ep, plan.microbatch, plan.schedule, plan.chunks, "selective", 1, order,
    )  # fmt: skip
    # the menus hold one order of each set that places the ranks alike (order 1 is order 0
    # when at most one dimension is placed)
    choice = space.canonical(choice)
    if plan.pp == 1 and plan.schedule == "gpipe":  # the space lists gpipe only for pp > 1
        return
    expected = config.check_plan(model, CLUSTER, space.plan_spec(choice), n_gpus) == []
    assert space.is_valid(choice) == expected
    if expected and n_gpus <= 64:
        assert choice in space.choices()


def test_enumeration_is_the_menus_filtered_by_the_rules():
    space = make_space(MOE, CLUSTER, 8, 16, microbatches=(1, 2, 4), chunks=(2, 4))
    menus = itertools.product(
        *[[1, 2, 4, 8]] * 4,  # tp, cp, dp, pp
        [1, 2, 4, 8],
        space.microbatches,
        [("gpipe", 1), ("1f1b", 1)] + [("interleaved", v) for v in space.chunks],
        ["none"],
        [0],
        [0],
    )
    brute = {
        c
        for *degrees, ep, mb, (sched, v), rec, zero, order in menus
        if space.is_valid(c := Choice(*degrees, ep, mb, sched, v, rec, zero, order))
    }
    listed = {c for c in space.choices() if c.recompute == "none" and c.zero == 0 and c.order == 0}
    assert brute == listed and len(listed) > 50
    for c in listed:
        assert config.check_plan(space.model, space.cluster, space.plan_spec(c), 8) == []


# --- the relaxed penalties ----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(MODELS, plans())
def test_penalties_vanish_on_rules_that_hold(model, plan):
    _, _, q = _traced(*_arrays(model, plan))
    exact = constraints.spec_quantities(model, CLUSTER, plan)
    for r in RULES:
        holds = r.test(exact, EXACT)
        if r.ratio is not None:
            off = float(constraints.off_integer(r.ratio(q)))
            assert (off < PENALTY_TOL) or not holds
            if r.name != "layers":  # layers: pp may divide them while pp * chunks does not
                assert (off < PENALTY_TOL) == holds
        if r.excess is not None and holds:
            assert float(r.excess(q)) <= PENALTY_TOL


def test_relaxed_penalties_are_smooth_in_the_degrees():
    model, plan, cluster = _arrays(LLAMA, PlanSpec(tp=4, pp=2, dp=2, global_batch=16))

    def total(log2_tp):
        relaxed = plan.replace(tp=2.0**log2_tp, dp=2.0 ** (4.0 - log2_tp))
        divisibility, excess = constraints.relaxed_penalties(model, relaxed, cluster)
        return divisibility + jnp.sum(jax.nn.relu(excess) ** 2)

    assert float(total(2.0)) < PENALTY_TOL
    assert float(total(1.5)) > 0.1
    check_grads(total, (1.7,), order=1, modes=["rev"])


# --- the table itself ---------------------------------------------------------------------


def test_each_rule_reads_only_what_it_declares():
    q = constraints.spec_quantities(MOE, CLUSTER, PlanSpec(tp=2, cp=2, dp=2, global_batch=8))
    for r in RULES:
        assert r.reads <= set(q), r.name
        r.test({k: q[k] for k in r.reads}, EXACT)  # a KeyError names an undeclared read
    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)
    assert all(set(r.requires) <= set(names[: names.index(r.name)]) for r in RULES)


def test_partial_plans_are_checked_as_far_as_they_go():
    assert constraints.holds({"heads": 16, "kv_heads": 4, "tp": 4})
    assert not constraints.holds({"heads": 16, "kv_heads": 4, "tp": 8})
    assert constraints.holds({"heads": 16, "kv_heads": 4, "tp": 8}, new=["seq_len"])


@pytest.mark.parametrize(
    ("seq_len", "cp", "valid"),
    [(1000, 1, True), (1000, 4, True), (1000, 8, False), (12, 3, True), (6, 2, False)],
)
def test_context_parallelism_cuts_the_sequence_in_2cp_chunks(seq_len, cp, valid):
    """Megatron-Core's load-balanced causal split: 2 * cp chunks for cp > 1, none for cp = 1."""
    model = dataclasses.replace(LLAMA, seq_len=seq_len)
    plan = PlanSpec(cp=cp, global_batch=8)
    cluster = dataclasses.replace(CLUSTER, gpus_per_node=1)  # any GPU count fills nodes
    assert (config.check_plan(model, cluster, plan) == []) == valid
    assert bool(_traced(*_arrays(model, plan, cluster))[0]) == valid
    space = Space(model, cluster, cp, 8)
    assert space.is_valid(Choice(1, cp, 1, 1, 1, 1, "1f1b", 1, "none", 0, 0)) == valid


def test_interleaving_needs_stages_and_microbatch_groups():
    plan = PlanSpec(pp=4, dp=2, global_batch=12, schedule="interleaved", chunks=2)
    problems = config.check_plan(LLAMA, CLUSTER, plan)
    assert problems == [
        "schedule='interleaved' needs the number of microbatches (6) to be a multiple of "
        "pp=4: the interleaved schedule runs them in groups of pp; nearest valid "
        "global_batch: 8 or 16"
    ]
    assert config.check_plan(LLAMA, CLUSTER, plan, strict=False) == []
    one_stage = dataclasses.replace(plan, pp=1, dp=8, global_batch=16)
    assert any(
        "at least 2 pipeline stages" in p for p in config.check_plan(LLAMA, CLUSTER, one_stage)
    )


def test_one_order_of_the_parallel_dimensions():
    assert Choice._fields[:4] == PLACED_DIMS
    space = make_space(LLAMA, CLUSTER, 16, 64)
    for t in space.degree_tuples():
        c = next(c for c in space.choices() if (c.tp, c.cp, c.dp, c.pp) == t)
        assert tuple(getattr(c, d) for d in PLACED_DIMS) == t
