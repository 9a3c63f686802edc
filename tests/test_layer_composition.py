"""The data analysis of benchmarks/layer_composition.py on hand-made rows."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from helpers import SHARED_DATA

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "layer_composition.py"
_spec = importlib.util.spec_from_file_location("layer_composition", _PATH)
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)

GRID = [(layers, gb) for layers in (12, 16, 20, 24) for gb in (8, 16, 32)]


def _rows(time_of, pp=1, dp=1, microbatch=1, source="s"):
    rows = []
    for layers, gb in GRID:
        r = {c: "x" for c in lc.CELL_KEY}
        r.update(
            source=source,
            pp=str(pp),
            dp=str(dp),
            microbatch=str(microbatch),
            n_layers=str(layers),
            global_batch=str(gb),
            measured_iter_s=str(time_of(layers, gb / (microbatch * dp))),
        )
        rows.append(r)
    return rows


def _composed(pp):
    # a whole-model per-layer, per-microbatch time of 3 ms, split over pp stages
    return lambda layers, n: 0.002 + 1e-4 * layers + n * (0.004 + 0.003 / pp * layers)


def test_composed_times_fit_exactly_and_agree_across_layouts():
    rows = _rows(_composed(1)) + _rows(_composed(2), pp=2) + _rows(_composed(4), pp=4, dp=2)
    out = lc.analyse(rows)["s"]
    assert out["cells"] == 3 and out["rows"] == 3 * len(GRID)
    assert out["max_residual_pct"] < 1e-9
    assert out["cells_below_0.01_pct"] == 3
    assert out["layer_shapes_with_several_layouts"] == 1
    assert out["max_d_times_pp_spread_pct"] < 1e-9


def test_measurement_noise_shows_in_the_residual_and_the_layout_spread():
    rng = np.random.default_rng(0)

    def noisy(pp):
        f = _composed(pp)
        return lambda layers, n: f(layers, n) * (1.0 + 0.03 * rng.standard_normal())

    out = lc.analyse(_rows(noisy(1)) + _rows(noisy(2), pp=2))["s"]
    assert out["max_residual_pct"] > 1.0
    assert out["cells_below_0.01_pct"] == 0
    assert out["max_d_times_pp_spread_pct"] > 0.1


def test_cells_that_cannot_pin_four_terms_are_skipped():
    one_layer_count = [r for r in _rows(_composed(1)) if r["n_layers"] == "12"]
    few = _rows(_composed(1))[:4]
    assert lc.fit_cell([(12, n, 1.0) for n in (1, 2, 4, 8, 16)]) is None  # rank 2
    assert lc.analyse(one_layer_count) == {}
    assert lc.analyse(few) == {}


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared data not present at {SHARED_DATA}")
def test_command_line_reports_the_vtrain_cells(capsys):
    data = SHARED_DATA
    assert lc.main(["--json", "--data", str(data)]) == 0
    assert "vtrain_ground_truth_single" in capsys.readouterr().out
    assert lc.main(["--source", "no-such-source", "--data", str(data)]) == 2
    assert "no-such-source" in capsys.readouterr().err
