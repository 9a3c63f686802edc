"""Strict YAML topologies: what loads, and the messages for what does not."""

import pytest

from diffcost.network import flow
from diffcost.network.load import GENERATORS, available_topologies, load_topology
from diffcost.spec_values import ConfigError

PRESETS = {
    "dgx-h100-superpod",
    "leaf-spine-2to1",
    "tpu-torus-4x4x4",
    "gb200-nvl72-racks",
    "dgx1-cube-mesh",
    "perftop-exponential-16",
    "tree-4x2",
}


def _write(tmp_path, text):
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    return path


def test_the_presets_the_issue_asks_for_exist():
    assert PRESETS <= set(available_topologies())


def test_units_and_composition(tmp_path):
    t = load_topology(
        _write(
            tmp_path,
            "name: two-nodes\n"
            "generator: hierarchical\n"
            "domains: 2\n"
            "domain: {generator: mesh, gpus: 4, link: {bandwidth_GBps: 10, latency_us: 2}}\n"
            "fabric: {generator: leaf_spine, leaves: 2, hosts_per_leaf: 2,\n"
            "         link: {bandwidth_Gbps: 80}}\n",
        )
    )
    assert t.name == "two-nodes" and len(t.endpoints) == 8
    assert set(t.bandwidth_Bps.tolist()) == {10e9, 80e9 / 8, 2 * 80e9 / 8}
    assert flow.bisection_Bps(t) == pytest.approx(2 * 10e9)  # the two NICs of one node
    assert t.latency_s.max() == pytest.approx(2e-6)


def test_explicit_links(tmp_path):
    t = load_topology(
        _write(
            tmp_path,
            "generator: explicit\n"
            "nodes: [gpu, gpu, nvswitch]\n"
            "links:\n"
            "  - {a: 0, b: 2, bandwidth_GBps: 5}\n"
            "  - {a: 1, b: 2, bandwidth_GBps: 5, count: 2}\n",
        )
    )
    assert t.endpoints.tolist() == [0, 1] and t.degree().tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "text,match",
    [
        ("generator: torus\ndims: [4]\nlink: {bandwidth_GBps: 1}\nfoo: 1\n", "unknown key 'foo'"),
        ("generator: torus\ndimz: [4]\nlink: {bandwidth_GBps: 1}\n", "did you mean 'dims'"),
        ("generator: torrus\n", "generator='torrus' is invalid: expected one of"),
        ("dims: [4]\n", "generator is missing"),
        ("generator: torus\nlink: {bandwidth_GBps: 1}\n", "missing 'dims'"),
        ("generator: torus\ndims: [4, 0]\nlink: {bandwidth_GBps: 1}\n", r"dims\[1\]=0"),
        ("generator: mesh\ngpus: 4\nlink: {bandwidth_GBps: 1, bandwidth_Gbps: 8}\n", "exactly one"),
        ("generator: mesh\ngpus: 4\nlink: {bandwith_GBps: 1}\n", "did you mean 'bandwidth_GBps'"),
        ("generator: mesh\ngpus: 4\nlink: {bandwidth_GBps: -1}\n", "link.bandwidth_GBps=-1"),
        (
            "generator: fat_tree\nlevels: 2\nradix: 10\noversubscription: 2\n"
            "link: {bandwidth_GBps: 1}\n",
            "cannot be split 2:1",
        ),
        (
            "generator: hierarchical\ndomains: 3\n"
            "domain: {generator: switch_domain, gpus: 8, link: {bandwidth_GBps: 1}}\n"
            "fabric: {generator: tree, fanout: 2, depth: 2, link: {bandwidth_GBps: 1},"
            " spines: 1}\n",
            r"unknown key 'fabric.spines'",
        ),
        (
            "generator: hierarchical\ndomains: 3\n"
            "domain: {generator: switch_domain, gpus: 8, link: {bandwidth_GBps: 1}}\n"
            "fabric: {generator: tree, fanout: 2, depth: 2, link: {bandwidth_GBps: 1}}\n",
            "4 hosts for 3 domains",
        ),
        ("generator: cluster\ncluster: dgx-h99\nnodes: 2\n", "cluster: unknown cluster preset"),
        ("generator: mesh\ngpus: 4\ngpus: 5\nlink: {bandwidth_GBps: 1}\n", "duplicate key"),
    ],
)
def test_bad_files_name_file_field_value(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_topology(_write(tmp_path, text))
    assert "topo.yaml" in str(err.value)


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match="did you mean 'tree-4x2'"):
        load_topology("tree-4x3")


def test_every_generator_is_documented():
    text = (
        pytest.importorskip("pathlib").Path(__file__).parent.parent / "docs/network.md"
    ).read_text()
    for name in GENERATORS:
        assert f"`{name}`" in text, name
