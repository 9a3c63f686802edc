"""Held-out fits kept on disk: read back as written, missed when anything they depend on
changes."""

import dataclasses

import numpy as np

from calibration.fit import FitConfig
from calibration.fit_cache import FitCache


def _tree(tmp_path):
    root, data = tmp_path / "root", tmp_path / "data"
    for pkg in ("diffcost", "calibration"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "m.py").write_text("x = 1\n")
    data.mkdir()
    (data / "runs.csv").write_text("a,b\n1,2\n")
    return root, data


def test_a_fit_is_read_back_as_written(tmp_path):
    root, data = _tree(tmp_path)
    cache = FitCache(tmp_path / "fits", root, data)
    mask, cfg = np.array([True, False, True]), FitConfig(steps=10)
    assert cache.get(mask, cfg) is None
    cache.put(mask, cfg, (7, {"a": np.arange(3.0)}, {"e2e": np.ones(3)}))
    steps, tables, w = cache.get(mask, cfg)
    assert steps == 7 and np.array_equal(tables["a"], np.arange(3.0))
    assert np.array_equal(w["e2e"], np.ones(3))


def test_the_key_changes_with_the_mask_the_settings_the_code_and_the_data(tmp_path):
    root, data = _tree(tmp_path)
    mask, cfg = np.array([True, False, True]), FitConfig(steps=10)
    key = FitCache(tmp_path / "fits", root, data).key(mask, cfg)
    cache = FitCache(tmp_path / "fits", root, data)
    assert cache.key(mask, cfg) == key  # deterministic
    assert cache.key(~mask, cfg) != key
    assert cache.key(mask, dataclasses.replace(cfg, steps=11)) != key
    (root / "calibration" / "m.py").write_text("x = 2\n")
    assert FitCache(tmp_path / "fits", root, data).key(mask, cfg) != key
    (root / "calibration" / "m.py").write_text("x = 1\n")
    (data / "more.csv").write_text("c\n3\n")
    assert FitCache(tmp_path / "fits", root, data).key(mask, cfg) != key


def test_without_a_folder_nothing_is_kept(tmp_path):
    root, data = _tree(tmp_path)
    cache = FitCache(None, root, data)
    mask, cfg = np.array([True]), FitConfig()
    cache.put(mask, cfg, (1, {}, {}))
    assert cache.get(mask, cfg) is None and not any(tmp_path.glob("**/*.pkl"))
