"""Smooth max-min fair sharing (diffcost.sharing) against its exact reference, and its invariants."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from diffcost import sharing, sharing_cases, sharing_reference

TARGET = 0.01  # smooth within 1% of exact on every case (issue 25)
EXACT_RTOL = 1e-6  # situations without near-ties, where the smooth model is exact up to rounding
GRAD_RTOL = 1e-3  # analytic gradients against central differences
PAD_RTOL = 1e-5  # padding only changes the softness scale of the smooth maxima


@functools.cache
def _corpus():
    cases = sharing_cases.corpus(n_random=50, seed=0)
    fn, args, unpad = sharing_cases.smooth_batch(cases)
    return cases, unpad(fn(*args))


def _j(*xs):
    return tuple(jnp.asarray(x, dtype=float) for x in xs)


def test_smooth_within_one_percent_of_exact_on_the_corpus():
    cases, results = _corpus()
    assert len(cases) >= 54
    errs = [sharing_cases.relative_errors(c, *r) for c, r in zip(cases, results)]
    worst = max(range(len(cases)), key=lambda i: errs[i].max())
    assert errs[worst].max() <= TARGET, (cases[worst].name, errs[worst].max())
    assert np.mean([e.mean() for e in errs]) <= TARGET / 10


def test_vmap_equals_one_case_at_a_time_and_jit_equals_eager():
    cases, results = _corpus()
    one = jax.jit(sharing.completion_times_s)
    for case, (done, _) in list(zip(cases, results))[::13]:
        args = _j(case.incidence, case.capacity_Bps, case.latency_s, case.flow_bytes)
        alone = np.asarray(one(*args))
        np.testing.assert_allclose(alone, done, rtol=PAD_RTOL)
        np.testing.assert_allclose(np.asarray(sharing.completion_times_s(*args)), alone, rtol=1e-12)


def test_padding_changes_nothing_beyond_the_softness():
    case = sharing_cases.corpus(n_random=3, seed=1)[2]
    padded = sharing_cases.pad(case, 30, 60)
    f = case.incidence.shape[0]
    args = _j(case.incidence, case.capacity_Bps, case.latency_s, case.flow_bytes)
    pargs = _j(padded.incidence, padded.capacity_Bps, padded.latency_s, padded.flow_bytes)
    got = np.asarray(sharing.completion_times_s(*pargs))
    np.testing.assert_allclose(got[:f], sharing.completion_times_s(*args), rtol=PAD_RTOL)
    assert np.all(got[f:] == 0.0)


def test_a_single_flow_gets_its_bottleneck():
    incidence = np.array([[1.0, 0.5, 0.5, 1.0]])  # an ECMP split over links 1 and 2
    capacity = np.array([100e9, 30e9, 40e9, 80e9])
    latency = np.array([1e-6, 2e-6, 3e-6, 4e-6])
    rate = float(sharing.max_min_rates(*_j(incidence, capacity))[0])
    assert rate == pytest.approx(60e9, rel=EXACT_RTOL)  # 0.5 * rate <= 30 GB/s
    done = float(sharing.completion_times_s(*_j(incidence, capacity, latency, [6e9]))[0])
    assert done == pytest.approx(0.1 + 1e-6 + 1e-6 + 1.5e-6 + 4e-6, rel=EXACT_RTOL)


def test_equal_flows_on_one_link_split_it_evenly():
    incidence = np.ones((5, 1))
    rates = np.asarray(sharing.max_min_rates(*_j(incidence, [50e9])))
    np.testing.assert_allclose(rates, 10e9, rtol=EXACT_RTOL)
    done = np.asarray(sharing.completion_times_s(*_j(incidence, [50e9], [0.0], np.full(5, 1e9))))
    np.testing.assert_allclose(done, 0.1, rtol=EXACT_RTOL)


def test_sharing_never_beats_the_flow_alone():
    cases, results = _corpus()
    for case, (done, _) in zip(cases, results):
        alone = sharing_reference.max_min_rates(case.incidence, case.capacity_Bps)
        unshared = np.array(
            [
                sharing_reference.max_min_rates(case.incidence[f : f + 1], case.capacity_Bps)[0]
                for f in range(len(alone))
            ]
        )
        assert np.all(alone <= unshared * (1 + EXACT_RTOL))
        floor = case.flow_bytes / unshared + case.incidence @ case.latency_s
        assert np.all(done >= floor * (1 - EXACT_RTOL)), case.name


def test_textbook_max_min_example():
    # Bertsekas & Gallager's example: links A, B, C of capacity 1; flow 0 crosses A and B,
    # flows 1 and 2 cross A, flow 3 crosses B and C, flow 4 crosses C.
    incidence = np.array([[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 1, 1], [0, 0, 1]], dtype=float)
    want = [1 / 3, 1 / 3, 1 / 3, 1 / 2, 1 / 2]
    np.testing.assert_allclose(sharing_reference.max_min_rates(incidence, np.ones(3)), want)
    got = sharing.max_min_rates(*_j(incidence, np.ones(3)))
    np.testing.assert_allclose(got, want, rtol=EXACT_RTOL)


def test_flows_that_finish_speed_up_the_others():
    # two flows on one link of 10 B/s: 10 and 20 bytes finish at 2 s and 3 s
    args = ([[1.0], [1.0]], [10.0], [0.0], [10.0, 20.0])
    np.testing.assert_allclose(sharing_reference.completion_times_s(*args), [2.0, 3.0])
    np.testing.assert_allclose(sharing.completion_times_s(*_j(*args)), [2.0, 3.0], rtol=1e-6)
    span = sharing.group_makespan_s(jnp.array([2.0, 3.0]), jnp.array([1, 1]), 2)
    np.testing.assert_allclose(span, [0.0, 3.0], rtol=1e-6)


def test_zero_byte_and_linkless_flows_take_no_time():
    incidence = np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    args = (incidence, [10.0, 10.0], [0.5, 0.25], [0.0, 5.0, 10.0])
    want = [0.5, 0.0, 1.0 + 0.75]
    np.testing.assert_allclose(sharing_reference.completion_times_s(*args), want)
    np.testing.assert_allclose(sharing.completion_times_s(*_j(*args)), want, rtol=1e-6)


def _log_scaled(case, which):
    """completion times as a function of log-multipliers on capacities or sizes."""
    base = _j(case.incidence, case.capacity_Bps, case.latency_s, case.flow_bytes)

    def f(s):
        a, c, lat, b = base
        if which == "capacity":
            c = c * jnp.exp(s)
        else:
            b = b * jnp.exp(s)
        return jnp.sum(
            sharing.completion_times_s(a, c, lat, b) / (1.0 + jnp.arange(a.shape[0], dtype=a.dtype))
        )

    return f, (case.capacity_Bps if which == "capacity" else case.flow_bytes)


@pytest.mark.parametrize("which", ["capacity", "bytes"])
def test_gradients_match_finite_differences(which):
    case = sharing_cases.structured_cases()[1]  # two collectives crossing one uplink
    f, x = _log_scaled(case, which)
    s0 = jnp.zeros(len(x))
    check_grads(f, (s0,), order=1, modes=("rev",), eps=1e-5, rtol=GRAD_RTOL, atol=0.0)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_gradients_are_finite_at_ties_and_with_padding(dtype):
    # five equal flows on one link (a tie everywhere), one zero-byte and one padding flow
    incidence = np.vstack([np.ones((5, 2)), [[1.0, 0.0]], [[0.0, 0.0]]])
    sizes = np.array([1e9] * 5 + [0.0, 0.0])

    def f(c, b):
        done = sharing.completion_times_s(jnp.asarray(incidence, dtype), c, jnp.zeros(2, dtype), b)
        return jnp.sum(sharing.group_makespan_s(done, jnp.array([0] * 5 + [1, -1]), 2))

    gc, gb = jax.grad(f, argnums=(0, 1))(jnp.array([50e9, 80e9], dtype), jnp.asarray(sizes, dtype))
    assert np.all(np.isfinite(gc)) and np.all(np.isfinite(gb))
    assert float(gc[0]) < 0.0  # the bottleneck's capacity shortens the makespan
    assert abs(float(gc[1])) < 1e-6 * abs(float(gc[0]))  # the other link does not matter


def test_the_reference_names_bad_inputs():
    with pytest.raises(ValueError, match="capacity_Bps: link 1 has capacity 0"):
        sharing_reference.max_min_rates(np.ones((1, 2)), [1.0, 0.0])
    with pytest.raises(ValueError, match="incidence: flow 0, link 1 has fraction 1.5"):
        sharing_reference.max_min_rates([[1.0, 1.5]], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"flow_bytes: need shape \(1,\)"):
        sharing_reference.completion_times_s([[1.0]], [1.0], [0.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="latency_s: entry 0 is -1.0"):
        sharing_reference.completion_times_s([[1.0]], [1.0], [-1.0], [1.0])


def test_multiplicity_stands_for_identical_flows():
    # 3 copies of flow 0 and 2 of flow 1 against one flow 2, written once per class
    incidence = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    capacity, latency = np.array([40e9, 30e9, 50e9]), np.full(3, 1e-6)
    sizes, copies = np.array([1e9, 2e9, 3e9]), np.array([3, 2, 1])
    rows = np.repeat(np.arange(3), copies)
    expanded = sharing_reference.completion_times_s(incidence[rows], capacity, latency, sizes[rows])
    exact = sharing_reference.completion_times_s(incidence, capacity, latency, sizes, copies)
    np.testing.assert_allclose(exact, expanded[[0, 3, 5]])
    got = sharing.completion_times_s(
        *_j(incidence, capacity, latency, sizes), multiplicity=jnp.asarray(copies, dtype=float)
    )
    np.testing.assert_allclose(got, exact, rtol=TARGET / 10)


def test_a_later_start_is_one_more_event():
    # 10 B/s link: flow 0 (10 B) alone until flow 1 (20 B) starts at 0.5 s, then both at 5 B/s
    args = ([[1.0], [1.0]], [10.0], [0.0], [10.0, 20.0])
    exact = sharing_reference.completion_times_s(*args, start_s=[0.0, 0.5])
    np.testing.assert_allclose(exact, [1.5, 3.0])
    got = sharing.completion_times_s(*_j(*args), start_s=jnp.array([0.0, 0.5]))
    np.testing.assert_allclose(got, exact, rtol=1e-5)


def test_staggered_starts_within_one_percent_of_exact():
    cases = sharing_cases.staggered(sharing_cases.corpus(n_random=10, seed=2), seed=3)
    fn, args, unpad = sharing_cases.smooth_batch(cases)
    errs = [sharing_cases.relative_errors(c, *r) for c, r in zip(cases, unpad(fn(*args)))]
    assert max(e.max() for e in errs) <= TARGET


def test_makespan_gradients_with_starts_and_multiplicity_match_finite_differences():
    case = sharing_cases.structured_cases()[3]  # ECMP over two unequal spines
    n = len(case.flow_bytes)
    copies = jnp.asarray(np.where(np.arange(n) % 2 == 0, 2.0, 1.0))
    # a start at exactly 0 is a kink (time 0 is the earliest start): keep away from it
    start0_ms = jnp.asarray(np.linspace(0.1, 2.0, n))
    a, c, lat, b = _j(case.incidence, case.capacity_Bps, case.latency_s, case.flow_bytes)

    def f(log_c, start_ms):
        group = jnp.asarray(case.group)
        start = start_ms * 1e-3
        span = sharing.makespan_s(
            a, c * jnp.exp(log_c), lat, b, group, case.n_groups, copies, start
        )
        return jnp.sum(span * jnp.arange(1.0, case.n_groups + 1.0))

    args = (jnp.zeros(len(case.capacity_Bps)), start0_ms)
    check_grads(f, args, order=1, modes=("rev",), eps=1e-7, rtol=GRAD_RTOL, atol=0.0)


def test_few_flows_within_one_percent_of_exact():
    """``few_flows_completion_s`` (the three-flow sharing of the network path) against the
    exact reference on ``sharing_cases.few_flow_sets``, in float64 and float32."""
    rows, capacity = sharing_cases.few_flow_sets(300, seed=0)
    fn = jax.jit(jax.vmap(sharing.few_flows_completion_s))
    for dtype in (jnp.float64, jnp.float32):
        got = np.asarray(fn(jnp.asarray(rows, dtype), jnp.asarray(capacity, dtype)), float)
        errs = sharing_cases.few_flow_errors(got, rows, capacity)
        assert errs.max() <= TARGET, (dtype, int(errs.argmax()), errs.max())


def test_few_flows_gradients_finite_in_float32_compiled():
    """Compiled and batched in float32, as the sweeps run it, the gradient of every set of
    ``sharing_cases.few_flow_sets(2000, seed=1)`` with respect to the rows and the capacities
    is finite (a set whose congestions are quotients by nearly saturated links' capacities
    once gave NaN, from XLA merging divisions)."""
    rows, capacity = sharing_cases.few_flow_sets(2000, seed=1)
    f = lambda r, c: jnp.sum(sharing.few_flows_completion_s(r, c) * jnp.arange(1.0, 4.0))
    with jax.numpy_dtype_promotion("standard"):
        grads = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1))))(
            jnp.asarray(rows, jnp.float32), jnp.asarray(capacity, jnp.float32)
        )
    for g in grads:
        assert g.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(g)))


def test_few_flows_agree_with_completion_times():
    """The same smooth model as ``completion_times_s`` with unit sizes, where no two levels or
    finishes are near ties: three equal flows, disjoint tiers, two flows sharing one tier."""
    rows = np.array(
        [[[4.0, 0, 0]] * 3, [[3, 0, 0], [0, 2, 0], [0, 0, 1]], [[1, 2, 0], [0, 1, 1], [0, 0, 0]]]
    )
    capacity = jnp.asarray([10.0, 5.0, 2.0])
    for r in rows:
        general = sharing.completion_times_s(*_j(r, capacity, np.zeros(3), np.ones(3)))
        few = sharing.few_flows_completion_s(*_j(r, capacity))
        np.testing.assert_allclose(few, general, rtol=EXACT_RTOL)


def test_few_flows_gradients_at_ties_match_finite_differences():
    rows = jnp.asarray([[4e8, 1e8, 0.0], [4e8, 0.0, 0.0], [4e8, 0.0, 0.0]])
    capacity = jnp.asarray([1.5e11, 2.5e10, 1.25e10])
    f = lambda s: sharing.few_flows_completion_s(rows, capacity * jnp.exp(s))
    check_grads(f, (jnp.zeros(3),), order=1, modes=("rev",), eps=1e-5, rtol=GRAD_RTOL, atol=0.0)
