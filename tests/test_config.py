"""Tests of strict YAML loading, presets, overrides and plan validation (diffcost.config)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import SHARED_DATA, write

from diffcost import config
from diffcost.arrays import plan_arrays
from diffcost.config import (
    ConfigError,
    available_presets,
    check_plan,
    load_cluster,
    load_experiment,
    load_model,
    load_plan,
    parse_overrides,
)
from diffcost.specs import PLACED_DIMS, ClusterSpec, MoeSpec, PlanSpec

CONFIGS = Path(config.__file__).resolve().parent.parent / "configs"
DATA = SHARED_DATA

# Clusters named by the measured data (data/README.md section 4) plus two extra systems.
REQUIRED_CLUSTERS = {
    "vtrain-a100", "selene-a100-80g", "dgx-h100", "dgx-b200", "dgx-gb200-nvl72",
    "dgx-gb300-nvl72", "mosaic-a100-40g", "mosaic-a100-80g", "mosaic-h100", "dgx2h-v100",
    "aws-p3.16xlarge", "meta-h100-roce", "generic-a100-80g", "generic-a100", "generic-h100",
    "generic-v100", "generic-b200", "generic-gb200-nvl72", "generic-gb300-nvl72",
    "generic-mi350", "gcp-a3-mega",
}  # fmt: skip
REQUIRED_MODELS = {
    "gpt3-175b", "megatron-22b", "turing-nlg-530b", "megatron-1t", "llama2-7b", "llama2-70b",
    "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b",
}  # fmt: skip


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    return write(
        tmp_path / "tiny.yaml",
        """
        base: _gpt
        n_layers: 4
        hidden: 256
        ffn_hidden: 1024
        heads: 8
        kv_heads: 8
        seq_len: 512
        vocab: 1000
        """,
    )


# ------------------------------------------------------------------------------------------
# Presets and examples.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", available_presets("models"))
def test_every_model_preset_loads(name):
    model = load_model(name)
    assert model.name == name
    assert model.hidden % model.heads == 0 and model.heads % model.kv_heads == 0


@pytest.mark.parametrize("name", available_presets("clusters"))
def test_every_cluster_preset_loads(name):
    cluster = load_cluster(name)
    assert cluster.name == name
    assert cluster.description
    assert cluster.gpu.peak_tflops and all(v > 0 for v in cluster.gpu.peak_tflops.values())


@pytest.mark.parametrize("name", available_presets("plans"))
def test_every_plan_preset_loads(name):
    plan = load_plan(name)
    assert sorted(plan.order) == sorted(PLACED_DIMS)


@pytest.mark.parametrize("name", available_presets("examples"))
def test_every_example_validates(name):
    exp = load_experiment(CONFIGS / "examples" / f"{name}.yaml")
    assert exp.source == f"examples/{name}.yaml"
    assert check_plan(exp.model, exp.cluster, exp.plan) == []


def test_required_presets_exist_and_bases_are_hidden():
    assert REQUIRED_MODELS.issubset(available_presets("models"))
    assert REQUIRED_CLUSTERS.issubset(available_presets("clusters"))
    assert {"gpt3-175b", "llama3-70b-h100", "llama3-8b-fsdp", "mixtral-8x7b", "gpt-1b-vtrain"} <= (
        set(available_presets("examples"))
    )
    assert not any(n.startswith("_") for k in config.KINDS for n in available_presets(k))


@pytest.mark.skipif(not DATA.is_dir(), reason="shared data folder not present")
def test_every_cluster_in_the_data_has_a_preset():
    import csv

    used = set()
    for csv_path in (DATA / "e2e" / "calibration.csv", DATA / "collectives" / "collectives.csv"):
        with open(csv_path, newline="") as stream:
            used |= {row["cluster"] for row in csv.DictReader(stream)}
    assert used - set(available_presets("clusters")) == set()


def test_preset_facts():
    assert load_cluster("dgx-h100").gpu.peak_tflops["bf16"] == 989
    assert load_cluster("dgx-h100").nvlink_GBps == 900
    assert load_cluster("selene-a100-80g").gpu.memory_GiB == 80
    assert "fp8" not in load_cluster("selene-a100-80g").gpu.peak_tflops
    assert "bf16" not in load_cluster("dgx2h-v100").gpu.peak_tflops
    assert load_cluster("dgx2h-v100").gpus_per_node == 16
    assert load_cluster("dgx-gb200-nvl72").gpus_per_node == 72
    vtrain = load_cluster("vtrain-a100")
    assert (vtrain.nvlink_GBps, vtrain.nics_per_node * vtrain.nic_Gbps) == (600, 800)
    gpt3 = load_model("gpt3-175b")
    assert (gpt3.mlp, gpt3.norm, gpt3.tied_embeddings, gpt3.ffn_hidden) == (
        "gelu", "layernorm", True, 4 * gpt3.hidden,
    )  # fmt: skip
    llama = load_model("llama3-405b")
    assert (llama.mlp, llama.norm, llama.tied_embeddings, llama.bias) == (
        "swiglu", "rmsnorm", False, False,
    )  # fmt: skip
    assert load_model("mixtral-8x7b").moe == MoeSpec(experts=8, top_k=2, capacity_factor=1.0)


def test_gpt3_example_plan():
    exp = load_experiment("gpt3-175b")
    plan = exp.plan
    assert (plan.tp, plan.pp, plan.dp, plan.n_gpus) == (8, 16, 8, 1024)
    assert (plan.schedule, plan.chunks, plan.order) == ("interleaved", 2, ("tp", "cp", "dp", "pp"))
    assert exp.cluster.name == "selene-a100-80g"


# ------------------------------------------------------------------------------------------
# Overrides.
# ------------------------------------------------------------------------------------------


def test_parse_overrides_nested_and_typed():
    parsed = parse_overrides(
        [
            "plan.tp=4",
            "plan.recompute=full",
            "plan.order=[dp,tp,cp,pp]",
            "cluster.gpu.memory_GiB=40",
        ]
    )
    assert parsed == {
        "plan": {"tp": 4, "recompute": "full", "order": ["dp", "tp", "cp", "pp"]},
        "cluster": {"gpu": {"memory_GiB": 40}},
    }


@pytest.mark.parametrize("bad", ["plan.tp", "=4", "plan..tp=4"])
def test_parse_overrides_rejects_malformed(bad):
    with pytest.raises(ConfigError, match="must look like key=value"):
        parse_overrides([bad])


def test_parse_overrides_conflict():
    with pytest.raises(ConfigError, match="conflicts"):
        parse_overrides(["plan=fsdp", "plan.tp=2"])


def test_overrides_change_plan_model_and_nested_cluster():
    exp = load_experiment(
        "llama3-70b-h100",
        ["plan.tp=8", "plan.dp=1", "model.seq_len=4096", "cluster.gpu.memory_GiB=40",
         "plan.order=[dp,tp,cp,pp]", "plan.recompute=full"],
    )  # fmt: skip
    assert (exp.plan.tp, exp.plan.dp, exp.plan.recompute) == (8, 1, "full")
    assert exp.plan.order == ("dp", "tp", "cp", "pp")
    assert exp.model.seq_len == 4096 and exp.model.name == "llama3-70b"
    assert exp.cluster.gpu.memory_GiB == 40
    assert exp.cluster.gpu.hbm_bandwidth_GBps == 3350  # untouched siblings survive
    assert exp.source.endswith("(with overrides)")


def test_override_tp_changes_tp():
    assert load_experiment("llama3-8b-fsdp", ["plan.tp=4", "plan.dp=2"]).plan.tp == 4


def test_override_replaces_a_section_by_preset():
    exp = load_experiment("llama3-70b-h100", ["model=llama2-70b"])
    assert exp.model.name == "llama2-70b" and exp.model.vocab == 32000


def test_override_unknown_path_suggests():
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'plan\.tpp' in overrides; did you mean 'plan\.tp'",
    ):
        load_experiment("gpt3-175b", ["plan.tpp=4"])
    with pytest.raises(
        ConfigError,
        match=r"'cluster\.gpu\.memory_gib'.*did you mean 'cluster\.gpu\.memory_GiB'",
    ):
        load_experiment("gpt3-175b", ["cluster.gpu.memory_gib=40"])


def test_load_functions_accept_override_mappings():
    assert load_model("llama3-8b", {"seq_len": 2048}).seq_len == 2048
    assert load_cluster("dgx-h100", {"gpu": {"memory_GiB": 40}}).gpu.memory_GiB == 40
    assert load_plan("fsdp", {"dp": 64}).dp == 64
    with pytest.raises(
        ConfigError,
        match="unknown key 'hiden' in overrides; did you mean 'hidden'",
    ):
        load_model("llama3-8b", {"hiden": 1})


def test_override_with_bad_value_names_field_and_value():
    with pytest.raises(
        ConfigError,
        match=r"plan\.recompute='sometimes' is invalid.*'none', 'selective', 'full'",
    ):
        load_experiment("gpt3-175b", ["plan.recompute=sometimes"])


@pytest.mark.parametrize(
    "share, valid",
    [("0", "a number > 0"), ("-0.5", "a number > 0"), ("1.5", r"fraction in \(0, 1\]")],
)
def test_recompute_fraction_outside_0_1_names_field_and_range(share, valid):
    with pytest.raises(ConfigError, match=rf"plan\.recompute_fraction={share} is invalid.*{valid}"):
        load_experiment("gpt3-175b", ["plan.recompute=full", f"plan.recompute_fraction={share}"])


def test_recompute_fraction_reaches_the_plan_arrays():
    exp = load_experiment("gpt3-175b", ["plan.recompute=full", "plan.recompute_fraction=0.25"])
    np.testing.assert_allclose(plan_arrays(exp.plan).recompute, [0.75, 0.0, 0.25])


# ------------------------------------------------------------------------------------------
# base: inheritance.
# ------------------------------------------------------------------------------------------


def test_base_preset_and_name_from_file(model_file):
    model = load_model(model_file)
    assert model.name == "tiny"
    assert (model.mlp, model.norm, model.bias) == ("gelu", "layernorm", True)


def test_base_chain_relative_paths_and_deep_merge(tmp_path):
    write(tmp_path / "a.yaml", "base: dgx-h100\ngpu: {memory_GiB: 96}\n")
    write(tmp_path / "sub" / "b.yaml", "base: ../a.yaml\nnic_Gbps: 800\n")
    cluster = load_cluster(tmp_path / "sub" / "b.yaml")
    assert (cluster.name, cluster.nic_Gbps, cluster.gpu.memory_GiB) == ("b", 800, 96)
    assert cluster.gpu.peak_tflops["fp8"] == 1979  # inherited from the dgx-h100 chain


def test_base_in_experiment_sections(tmp_path, model_file):
    exp_path = write(
        tmp_path / "exp.yaml",
        """
        gpus: 8
        model: {base: tiny.yaml, seq_len: 1024}
        cluster: {base: dgx-h100, gpu: {memory_GiB: 40}}
        plan: {base: fsdp, global_batch: 16}
        """,
    )
    exp = load_experiment(exp_path)
    assert (exp.model.name, exp.model.seq_len, exp.model.n_layers) == ("tiny", 1024, 4)
    assert (exp.cluster.gpu.memory_GiB, exp.plan.zero, exp.plan.global_batch) == (40, 3, 16)


def test_base_cycle_is_detected(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\nn_layers: 2\n")
    write(tmp_path / "b.yaml", "base: a.yaml\nhidden: 64\n")
    with pytest.raises(
        ConfigError,
        match=r"cycle of 'base:' references: .*a\.yaml -> .*b\.yaml -> .*a\.yaml",
    ):
        load_model(tmp_path / "a.yaml")


def test_self_base_is_a_cycle(tmp_path):
    write(tmp_path / "me.yaml", "base: me.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_plan(tmp_path / "me.yaml")


def test_missing_base(tmp_path):
    write(tmp_path / "m.yaml", "base: _gtp\n")
    with pytest.raises(
        ConfigError,
        match=r"m\.yaml: base: unknown model preset '_gtp'.*did you mean '_gpt'",
    ):
        load_model(tmp_path / "m.yaml")


# ------------------------------------------------------------------------------------------
# Load-time errors.
# ------------------------------------------------------------------------------------------


def test_unknown_key_did_you_mean(tmp_path, model_file):
    bad = write(tmp_path / "foo.yaml", model_file.read_text().replace("hidden:", "hiden:"))
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'hiden' in .*foo\.yaml; did you mean 'hidden'\?",
    ):
        load_model(bad)


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    bad = write(tmp_path / "p.yaml", "tp: 2\nbananas: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'bananas' .*valid: tp, pp, dp"):
        load_plan(bad)


def test_unknown_nested_keys(tmp_path):
    bad = write(tmp_path / "c.yaml", "base: dgx-h100\ngpu: {peak_tflops: {bf61: 1}}\n")
    with pytest.raises(
        ConfigError,
        match=r"'gpu\.peak_tflops\.bf61'.*did you mean 'gpu\.peak_tflops\.bf16'",
    ):
        load_cluster(bad)
    text = "model: {base: llama3-8b, n_layer: 2}\ncluster: dgx-h100\nplan: fsdp\n"
    bad = write(tmp_path / "e.yaml", text)
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'model\.n_layer' in .*e\.yaml; did you mean 'model\.n_layers'",
    ):
        load_experiment(bad)


def test_unknown_preset_lists_and_suggests():
    with pytest.raises(
        ConfigError,
        match=(
            r"unknown model preset 'llama3-7b'.*did you mean 'llama3-70b'\? Available presets in "
            r".*gpt3-175b"
        ),
    ):
        load_model("llama3-7b")
    with pytest.raises(ConfigError, match=r"unknown cluster preset 'dgx-h300'.*did you mean"):
        load_cluster("dgx-h300")


def test_missing_file():
    with pytest.raises(ConfigError, match="file not found"):
        load_model("no/such/file.yaml")


def test_duplicate_key_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"d\.yaml: invalid YAML: .*duplicate key 'tp'"):
        load_plan(write(tmp_path / "d.yaml", "tp: 2\ntp: 4\n"))
    with pytest.raises(ConfigError, match=r"y\.yaml: invalid YAML"):
        load_plan(write(tmp_path / "y.yaml", "tp: [2\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_plan(write(tmp_path / "l.yaml", "- tp\n"))


def test_missing_required_keys(tmp_path):
    bad = write(tmp_path / "m.yaml", "base: _llama\nn_layers: 2\nhidden: 64\n")
    with pytest.raises(ConfigError, match=r"m\.yaml: missing required keys 'ffn_hidden', 'heads'"):
        load_model(bad)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("tp: 2.5\n", r"tp=2\.5 is invalid: expected a positive integer \(got float\)"),
        ("tp: true\n", r"tp=True is invalid: expected a positive integer \(got bool\)"),
        ("dp: 0\n", r"dp=0 is invalid: expected a positive integer"),
        ("tp: '4'\n", r"tp='4' is invalid: expected a positive integer \(got str\)"),
        ("sequence_parallel: 1\n", r"sequence_parallel=1 is invalid: expected true or false"),
        ("zero: 4\n", r"zero=4 is invalid: expected one of 0, 1, 2, 3"),
        (
            "recompute: partial\n",
            r"recompute='partial' is invalid: expected one of 'none', 'selective', 'full'",
        ),
        (
            "schedule: zb\n",
            r"schedule='zb' is invalid: expected one of 'gpipe', '1f1b', 'interleaved'",
        ),
    ],
)
def test_plan_value_errors(tmp_path, text, pattern):
    path = write(tmp_path / "plan.yaml", text)
    with pytest.raises(ConfigError, match=r"plan\.yaml: " + pattern):
        load_plan(path)


@pytest.mark.parametrize(
    ("order", "shown"),
    [("[tp, dp, pp]", r"\['tp', 'dp', 'pp'\]"), ("[tp, tp, dp, pp]", r"\['tp', 'tp', 'dp', 'pp'\]"),
     ("tp", "'tp'"), ("[tp, cp, dp, ep]", r"\['tp', 'cp', 'dp', 'ep'\]")],
)  # fmt: skip
def test_bad_order(tmp_path, order, shown):
    path = write(tmp_path / "plan.yaml", f"order: {order}\n")
    with pytest.raises(
        ConfigError,
        match=rf"order={shown} is invalid: expected a permutation of \[tp, cp, dp, pp\]",
    ):
        load_plan(path)


def test_chunks_and_schedule(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"chunks=1 is invalid with schedule='interleaved': expected chunks >= 2",
    ):
        load_plan(write(tmp_path / "a.yaml", "schedule: interleaved\n"))
    with pytest.raises(
        ConfigError,
        match=(
            r"chunks=2 needs an interleaved pipeline.*schedule='1f1b'.*use schedule: interleaved"
        ),
    ):
        load_plan(write(tmp_path / "b.yaml", "pp: 2\nchunks: 2\n"))
    assert load_plan(write(tmp_path / "c.yaml", "schedule: interleaved\nchunks: 3\n")).chunks == 3


TINY = {"base": "_gpt", "n_layers": 4, "hidden": 256, "ffn_hidden": 1024, "heads": 8,
        "kv_heads": 8, "seq_len": 512, "vocab": 1000}  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"mlp": "relu"}, r"mlp='relu' is invalid: expected one of 'gelu', 'swiglu'"),
        ({"norm": "batchnorm"},
         r"norm='batchnorm' is invalid: expected one of 'layernorm', 'rmsnorm'"),
        ({"precision": "fp64"}, r"precision='fp64' is invalid: expected one of 'fp32', 'bf16'"),
        ({"kv_heads": 3}, r"heads=8 is not divisible by kv_heads=3; .*valid kv_heads: 1, 2, 4, 8"),
        ({"heads": 6, "kv_heads": 6},
         r"hidden=256 is not divisible by heads=6 \(head size would be 42\.6667\)"),
        ({"moe": {"experts": 4, "top_k": 8}},
         r"moe\.top_k=8 is invalid: expected at most moe\.experts=4"),
        ({"moe": {"experts": 4}}, r"missing required key 'moe\.top_k'"),
        ({"moe": 8}, r"moe=8 is invalid: expected a mapping"),
        ({"tied_embeddings": "yes please"},
         r"tied_embeddings='yes please' is invalid: expected true or false"),
        ({"vocab": -5}, r"vocab=-5 is invalid: expected a positive integer"),
    ],
)  # fmt: skip
def test_model_value_errors(tmp_path, changes, pattern):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    with pytest.raises(ConfigError, match=r"m\.yaml: " + pattern):
        load_model(path)


def test_cluster_value_errors(tmp_path):
    cases = [
        ("nvlink_GBps: -1\n", r"nvlink_GBps=-1 is invalid: expected a number > 0"),
        ("nic_latency_us: -1\n", r"nic_latency_us=-1 is invalid: expected a number >= 0"),
        ("gpu: {hbm_bandwidth_GBps: 1e3}\n",
         r"gpu\.hbm_bandwidth_GBps='1e3' is invalid: .*YAML reads 1e3 as text.*1\.0e\+3"),
        ("gpu: {peak_tflops: {bf16: fast}}\n", r"gpu\.peak_tflops\.bf16='fast' is invalid"),
        ("gpus_per_node: 7.5\n", r"gpus_per_node=7\.5 is invalid: expected a positive integer"),
        ("intra_node: torus\n",
         r"intra_node='torus' is invalid: expected one of 'switch', 'mesh', 'cube-mesh'"),
        ("intra_node: cube-mesh\ngpus_per_node: 4\n",
         r"gpus_per_node=4 does not fit intra_node='cube-mesh': DGX-1's hybrid cube-mesh has 8"),
        ("intra_node: mesh\ngpus_per_node: 32\n",
         r"gpus_per_node=32 does not fit intra_node='mesh': expected at most 16"),
    ]  # fmt: skip
    for text, pattern in cases:
        path = write(tmp_path / "c.yaml", "base: dgx-h100\n" + text)
        with pytest.raises(ConfigError, match=pattern):
            load_cluster(path)
    ok = write(tmp_path / "ok.yaml", "base: dgx-h100\nnic_latency_us: 0\n")
    assert load_cluster(ok).nic_latency_us == 0


def test_experiment_missing_section(tmp_path):
    with pytest.raises(ConfigError, match=r"x\.yaml: missing required key 'plan'"):
        load_experiment(write(tmp_path / "x.yaml", "model: llama3-8b\ncluster: dgx-h100\n"))


def test_configs_dir_env_override(tmp_path, monkeypatch):
    write(tmp_path / "plans" / "mine.yaml", "dp: 2\nglobal_batch: 2\n")
    monkeypatch.setenv(config.CONFIGS_ENV, str(tmp_path))
    assert available_presets("plans") == ["mine"]
    assert load_plan("mine").dp == 2


def test_loading_has_no_side_effects(capsys):
    before = load_cluster("dgx-h100")
    exp = load_experiment("gpt3-175b", ["cluster.gpu.peak_tflops.bf16=1"])
    assert exp.cluster.gpu.peak_tflops["bf16"] == 1
    after = load_cluster("dgx-h100")  # the cached file was not mutated by the override
    assert after == before and after.gpu.peak_tflops["bf16"] == 989
    assert capsys.readouterr() == ("", "")


def test_specs_are_plain_dataclasses():
    cluster = load_cluster("dgx-h100")
    assert isinstance(cluster, ClusterSpec) and isinstance(load_plan("fsdp"), PlanSpec)


def test_experiment_base_and_lenient_loading(tmp_path):
    path = write(
        tmp_path / "child.yaml",
        """
        base: gpt3-175b
        gpus: 1024
        plan: {global_batch: 1001}
        """,
    )
    with pytest.raises(ConfigError, match=r"child\.yaml: invalid plan:\n  - global_batch=1001"):
        load_experiment(path)
    exp = load_experiment(path, strict=False)
    assert (exp.model.name, exp.plan.pp, exp.plan.global_batch) == ("gpt3-175b", 16, 1001)
