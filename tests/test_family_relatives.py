"""A GPU family with a relative of the same architecture (``gpus.FAMILY_PARENT``): calibration
draws the constants no data inform toward the relative's, and a family without a profile of
its own predicts with the relative's."""

import dataclasses

import jax
import numpy as np
import pytest

from calibration import fit as fit_mod
from diffcost import profiles as prof
from diffcost.config import load_cluster
from diffcost.params import default_params


def test_family_parents_point_to_the_relative_in_the_fit():
    parent, has = fit_mod.family_parents(["b200", "gb200", "a100", "h100", "h200"])
    assert parent.tolist() == [0, 0, 2, 3, 3]
    assert has.tolist() == [False, True, False, False, True]
    _, has = fit_mod.family_parents(["gb200", "a100"])  # the relative is not in the fit
    assert not has.any()
    _, has = fit_mod.family_parents(["b200", "gb200"], start={"x": default_params()})
    assert not has.any()  # a fit from profiles keeps its prior on them


def test_prior_pulls_a_child_toward_its_parent_and_not_back():
    problem = fit_mod.Problem(families=["b200", "gb200"], clusters=[], data={}, counts={})
    cfg = fit_mod.FitConfig()
    loss = fit_mod.make_loss(problem, cfg)
    dev, clu = fit_mod.initial_tables(problem)
    leaf = "attn_eff_logit"
    dev = {**dev, leaf: dev[leaf].at[0].add(1.0)}  # b200's 1 above the default, gb200's at it
    g = np.asarray(jax.grad(lambda t: loss(t, {}))((dev, clu))[0][leaf])
    per_unit = 2.0 * cfg.prior_weight / fit_mod.PRIOR_SD_LEAF[leaf] ** 2
    assert g[1] == pytest.approx(-per_unit)  # gb200 is pulled up toward b200's value
    assert g[0] == pytest.approx(per_unit)  # b200 only by its own prior, not toward gb200


def test_a_family_without_profile_predicts_with_its_relatives(tmp_path, monkeypatch):
    monkeypatch.setattr(prof, "PROFILES_DIR", tmp_path)
    dgx = load_cluster("dgx-h100")
    h200 = dataclasses.replace(dgx, gpu=dataclasses.replace(dgx.gpu, name="H200 SXM 141GB"))
    _, note = prof.params_for(h200)
    assert "datasheet defaults" in note
    prof.write_profile(prof.device_path("h100"), {"attn_eff": 0.61}, {"layer": "device"})
    params, note = prof.params_for(h200)
    assert float(params.attn_eff) == pytest.approx(0.61)
    assert "device-h100.yaml" in note and "no profile for h200 GPUs" in note
    assert float(params.attn_flash_odds) == pytest.approx(0.37)  # Hopper's family default
