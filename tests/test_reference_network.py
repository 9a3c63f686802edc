"""The network path's link sharing against its exact, event-driven reference on the graph
(``diffcost.reference_network``).

The reference routes every flow of the gradient bucket, the tensor-parallel collectives and
the pipeline send on the graph and shares links max-min fairly, event by event; the smooth
model shares one flow per collective on the busiest link of each tier. On the example configs
(symmetric layouts on the graphs their clusters describe) the two agree; on asymmetric random
layouts the tier abstraction overestimates the bucket time (``benchmarks/
topology_sharing_graph.py`` measures by how much), while the smoothing itself stays exact.
The per-link form, which does not, is checked in ``test_link_sharing.py``.
"""

from __future__ import annotations

from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.sparse as sp  # noqa: E402

from diffcost import reference_network, sharing_cases, sharing_jobs  # noqa: E402
from diffcost import sharing_reference as exact_sharing  # noqa: E402
from diffcost.network.load import load_topology  # noqa: E402
from diffcost.network.loads import incidence_entries  # noqa: E402
from diffcost.network.routing import route  # noqa: E402
from diffcost.network.tables import job_graph  # noqa: E402

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "configs" / "examples").glob("*.yaml"))
DESIGNS = sorted((Path(__file__).resolve().parent.parent / "configs" / "designs").glob("*.yaml"))
TARGET = 0.01  # the smooth bucket time within 1% of the exact one


_example = reference_network.example_job


@pytest.mark.parametrize("name", ["dgx1-cube-mesh", "tree-4x2", "leaf-spine-2to1"])
def test_incidence_entries_equal_routes(name):
    topology = load_topology(name)
    n = len(topology.endpoints)
    rng = np.random.default_rng(2)
    src, dst = rng.integers(0, n, 40), rng.integers(0, n, 40)
    flow, link, frac = incidence_entries(topology, src, dst)
    dense = sp.csr_matrix((frac, (flow, link)), shape=(40, topology.n_links)).toarray()
    np.testing.assert_allclose(dense, route(topology, src, dst).incidence, atol=1e-12)


def test_sparse_schedule_equals_sharing_reference():
    """The sparse event-driven schedule gives ``sharing_reference``'s completion times."""
    for case in sharing_cases.corpus(n_random=8, seed=3):
        a = case.incidence
        want = exact_sharing.completion_times_s(
            a, case.capacity_Bps, np.zeros_like(case.latency_s), case.flow_bytes
        )
        got = reference_network.finish_times_s(sp.csr_matrix(a), case.capacity_Bps, case.flow_bytes)
        np.testing.assert_allclose(got, want, rtol=1e-9, err_msg=case.name)


@pytest.mark.parametrize(
    "path", EXAMPLES + DESIGNS[:1], ids=[p.stem for p in EXAMPLES + DESIGNS[:1]]
)
def test_examples_match_the_exact_reference(path):
    model, plan, cluster, params, topology, n = _example(path)
    c = reference_network.compare(job_graph(topology, n), n, model, plan, cluster.network, params)
    print(
        f"\n{path.stem}: bucket alone smooth {c.smooth_alone_s:.6e} exact {c.exact_alone_s:.6e}"
        f", shared smooth {c.smooth_shared_s:.6e} exact {c.exact_shared_s:.6e} "
        f"({c.flows} flows, {c.links} links): error {c.shared_err:.2e}"
    )
    assert c.shared_err <= TARGET
    assert c.smooth_alone_s == pytest.approx(c.exact_alone_s, rel=TARGET, abs=1e-12)


def test_iteration_with_the_exact_delay():
    """``simulate_reference`` on the stage times with the exact delay: within the closed
    form's tolerance of the smooth prediction (``test_reference.E2E_REL_TOL``), and equal to
    the reference with the smooth delay where the two delays agree."""
    model, plan, cluster, params, topology, n = _example(EXAMPLES[0])
    c, it = reference_network.compare_job(model, plan, cluster, params, topology, n)
    assert c.exact_delay_s > 0  # the bucket does share links here
    assert it["reference_s"] == pytest.approx(it["smooth_s"], rel=5e-3)
    assert it["reference_s"] == pytest.approx(it["reference_smooth_delay_s"], rel=1e-6)


def test_random_jobs_smoothing_is_exact():
    """On random jobs the smooth sharing matches the exact sharing of its own tier rows; what
    differs from the routed reference is the tier abstraction, which only adds time here."""
    for job in sharing_jobs.corpus(4, seed=1):
        c = reference_network.compare(
            job_graph(job.topology, job.n_gpus), job.n_gpus, job.model, job.plan,
            job.cluster.network, job.params,
        )  # fmt: skip
        print(f"\n{job.name}: error {c.shared_err:.2e}, smoothing {c.smoothing_err:.2e}")
        assert c.smoothing_err <= 1e-3
        assert c.smooth_shared_s >= c.exact_shared_s * (1.0 - 1e-6)


def test_no_bucket_no_time():
    flows = reference_network.SharedFlows(
        sp.csr_matrix(np.ones((1, 1))), np.ones(1), np.ones(1), np.array([1])
    )
    assert reference_network.exact_bucket_s(flows) == (0.0, 0.0)
