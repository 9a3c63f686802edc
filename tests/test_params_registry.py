"""One registry entry per calibrated constant: Params, defaults, profiles, priors and labels
all come from ``diffcost.params.CONSTANTS``."""

import dataclasses

import numpy as np
import pytest

from calibration.fit import PRIOR_SD
from diffcost import profiles
from diffcost.params import CONSTANTS, LEVELS, Params, default_params
from diffcost.specs import PRECISIONS


def test_names_and_leaves_are_unique_and_levels_known():
    names = [c.name for c in CONSTANTS]
    leaves = [c.leaf for c in CONSTANTS]
    assert len(set(names)) == len(names) and len(set(leaves)) == len(leaves)
    assert {c.level for c in CONSTANTS} <= set(LEVELS)
    assert all(c.transform in ("log", "logit") and c.prior_sd > 0 for c in CONSTANTS)


def test_params_fields_follow_the_registry():
    assert [f.name for f in dataclasses.fields(Params)] == [c.leaf for c in CONSTANTS]
    params = default_params()
    for c in CONSTANTS:
        leaf = np.asarray(getattr(params, c.leaf))
        assert leaf.shape == c.shape, c.name
        value = np.asarray(getattr(params, c.name))  # the constrained property
        if c.is_grid:
            np.testing.assert_allclose(value, 1.0)
        elif isinstance(c.default, dict):
            np.testing.assert_allclose(value, [c.default[p] for p in PRECISIONS], rtol=1e-6)
        else:
            assert float(value) == pytest.approx(c.default, rel=1e-6), c.name


def test_profiles_and_priors_derive_from_the_registry():
    assert profiles.FIELDS == {c.name: (c.leaf, c.transform) for c in CONSTANTS}
    device = {c.name for c in CONSTANTS if c.level == "device"}
    assert set(profiles.DEVICE_FIELDS) == device
    assert set(profiles.CLUSTER_FIELDS) == set(profiles.FIELDS) - device
    assert PRIOR_SD == {c.name: c.prior_sd for c in CONSTANTS}


def test_profile_round_trip_of_every_constant():
    params = default_params()
    values = profiles.to_values(params)
    assert set(values) == {c.name for c in CONSTANTS}
    again = profiles.apply_values(default_params(), values)
    for c in CONSTANTS:
        np.testing.assert_allclose(getattr(again, c.leaf), getattr(params, c.leaf), atol=1e-6)


def test_family_defaults_replace_the_datasheet_default_for_their_family_only():
    from diffcost.config import load_cluster
    from diffcost.params import FAMILY_DEFAULTS

    assert default_params(family="h100").attn_flash_odds == pytest.approx(0.37, rel=1e-6)
    a100, plain = default_params(family="a100"), default_params()
    for c in CONSTANTS:  # a family without entries gets the datasheet defaults exactly
        np.testing.assert_array_equal(getattr(a100, c.leaf), getattr(plain, c.leaf))
    for family, entries in FAMILY_DEFAULTS.items():
        assert set(entries) <= {c.name for c in CONSTANTS if c.level == "device"}, family
    h100 = profiles.params_for(load_cluster("dgx-h100"), "none")[0]
    assert h100.attn_flash_odds == pytest.approx(0.37, rel=1e-6)


def test_flash_attention_2_is_slower_than_cudnn_on_hopper_not_on_ampere():
    from helpers import GPT, PLANS

    from diffcost import api
    from diffcost.config import load_cluster
    from diffcost.specs import Experiment

    def seconds(cluster, attention):
        model = dataclasses.replace(GPT, attention=attention, seq_len=8192)
        exp = Experiment(model=model, plan=PLANS["single"], cluster=load_cluster(cluster))
        return float(api.predict(exp, profile="none").iteration_s)

    assert seconds("dgx-h100", "flash") > 1.05 * seconds("dgx-h100", "cudnn")
    assert seconds("generic-a100-80g", "flash") == pytest.approx(
        seconds("generic-a100-80g", "cudnn"), rel=1e-9
    )
