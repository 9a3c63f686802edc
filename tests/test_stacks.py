"""Software stacks: the framework -> stack map, stack offsets in the fit, the shipped stack
profiles and the experiment's ``stack`` key."""

import csv
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from calibration import fit as fit_mod
from calibration.readers import read_e2e_csv
from diffcost import profiles as prof
from diffcost.config import ConfigError, load_cluster, load_experiment
from diffcost.params import default_params
from diffcost.stacks import EFFECT_BY_NAME, STACK_EFFECTS, STACK_NAMES, apply_stack, stack_of

SAMPLE = Path(__file__).parent / "data" / "e2e_sample.csv"
SHARED_FRAMEWORKS = {  # every framework cell of the shared data set, and its stack
    "Megatron-DeepSpeed": "megatron-deepspeed",
    "llm-foundry/Composer (PyTorch FSDP)": "pytorch-fsdp",
    "Megatron-Bridge (Megatron-Core)": "megatron-core",
    "NeMo (Megatron-Core)": "megatron-core",
    "torchtitan (PyTorch FSDP2)": "pytorch-fsdp",
    "Megatron-LM v1.0": "megatron-lm-v1",
    "Megatron-Core (Megatron-LM examples)": "megatron-core",
    "Alpa (JAX)": "jax-xla",
}


@pytest.mark.parametrize("framework,stack", sorted(SHARED_FRAMEWORKS.items()))
def test_frameworks_map_to_stacks(framework, stack):
    assert stack_of(framework) == stack


def test_unknown_or_blank_framework_has_no_stack():
    assert stack_of("") is None and stack_of(None) is None and stack_of("my own trainer") is None


def test_every_effect_shifts_a_params_leaf():
    p0 = default_params()
    shifted = apply_stack(p0, {e.leaf: 0.25 for e in STACK_EFFECTS})
    for e in STACK_EFFECTS:
        np.testing.assert_allclose(getattr(shifted, e.leaf), getattr(p0, e.leaf) + 0.25)
    assert shifted.gemm_eff_logit.shape == p0.gemm_eff_logit.shape  # every precision moves


def test_assemble_adds_the_row_stack_offset_and_none_for_an_unknown_stack():
    p0 = default_params()
    dev = {leaf: jnp.stack([getattr(p0, leaf)]) for leaf in fit_mod.DEVICE_LEAVES}
    clu = {leaf: jnp.stack([getattr(p0, leaf)]) for leaf in fit_mod.CLUSTER_LEAVES}
    clu.update({key: jnp.zeros(len(STACK_NAMES)) for key in fit_mod.STACK_KEYS})
    key = "stack/host_op_log_s"
    clu[key] = clu[key].at[STACK_NAMES.index("pytorch-fsdp")].set(0.5)
    s = jnp.array([STACK_NAMES.index("pytorch-fsdp"), -1, STACK_NAMES.index("jax-xla")])
    zeros = jnp.zeros(3, int)
    p = fit_mod.assemble(dev, clu, zeros, zeros, s)
    np.testing.assert_allclose(p.host_op_log_s, p0.host_op_log_s + np.array([0.5, 0.0, 0.0]))
    np.testing.assert_allclose(p.gemm_eff_logit, np.broadcast_to(p0.gemm_eff_logit, (3, 5)))


def test_e2e_records_carry_their_stack_and_the_problem_indexes_it():
    meas = read_e2e_csv(SAMPLE)
    with open(SAMPLE) as fh:
        frameworks = {int(i): r["framework"] for i, r in enumerate(csv.DictReader(fh), start=1)}
    for r in meas.e2e:
        assert r.stack == stack_of(frameworks[r.row])
    problem = fit_mod.build_problem(meas)
    s = np.asarray(problem.data["e2e"]["s"])
    assert [STACK_NAMES[i] if i >= 0 else None for i in s] == [r.stack for r in meas.e2e]


def test_a_fit_moves_only_the_stacks_its_rows_run():
    meas = read_e2e_csv(SAMPLE)
    result = fit_mod.fit(meas, fit_mod.FitConfig(steps=40), progress=False)
    ran = {r.stack for r in meas.e2e if r.stack}
    assert set(result.stack_values) == ran
    moved = [abs(v) for values in result.stack_values.values() for v in values.values()]
    assert max(moved) > 1e-4  # the data reach the offsets of the stacks they run
    held = fit_mod.fit(meas, fit_mod.FitConfig(steps=40, stacks=False), progress=False)
    assert all(v == 0.0 for values in held.stack_values.values() for v in values.values())


def test_stack_profiles_apply_their_offsets(tmp_path, monkeypatch):
    monkeypatch.setattr(prof, "PROFILES_DIR", tmp_path)
    cluster = load_cluster("dgx-h100")
    base, note = prof.params_for(cluster, stack="megatron-core")
    assert "no profile for stack megatron-core" in note
    prof.stack_path("megatron-core").write_text("offsets:\n  host_op_s: 0.5\n  gemm_eff: -0.2\n")
    params, note = prof.params_for(cluster, stack="megatron-core")
    assert "stack profile stack-megatron-core.yaml" in note
    np.testing.assert_allclose(params.host_op_log_s, base.host_op_log_s + 0.5)
    np.testing.assert_allclose(params.gemm_eff_logit, base.gemm_eff_logit - 0.2)
    same, _ = prof.params_for(cluster)  # no stack given: no offsets
    np.testing.assert_allclose(same.host_op_log_s, base.host_op_log_s)


@pytest.mark.parametrize(
    "text,message",
    [
        ("offsets:\n  nic_eff: 0.1\n", "offsets.nic_eff: not a stack constant"),
        ("offsets:\n  host_op_s: .nan\n", "expected a finite number"),
        ("constants: {}\n", "expected a mapping with 'offsets"),
    ],
)
def test_bad_stack_profiles_name_the_field(tmp_path, monkeypatch, text, message):
    monkeypatch.setattr(prof, "PROFILES_DIR", tmp_path)
    prof.stack_path("pytorch-fsdp").write_text(text)
    with pytest.raises(prof.ProfileError, match=message) as e:
        prof.params_for(load_cluster("mosaic-h100"), stack="pytorch-fsdp")
    assert "stack-pytorch-fsdp.yaml" in str(e.value)
    if "not a stack constant" in message:
        assert all(name in str(e.value) for name in EFFECT_BY_NAME)


def test_experiments_name_their_stack():
    exp = load_experiment("gpt3-175b.yaml", ["stack=megatron-core"])
    assert exp.stack == "megatron-core"
    assert load_experiment("gpt3-175b.yaml").stack is None
    with pytest.raises(ConfigError, match="stack='deepspeed' is invalid: expected one of"):
        load_experiment("gpt3-175b.yaml", ["stack=deepspeed"])
