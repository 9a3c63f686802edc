"""The data analysis of benchmarks/monotonicity_bound.py on hand-made rows."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "monotonicity_bound.py"
_spec = importlib.util.spec_from_file_location("monotonicity_bound", _PATH)
mb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mb)


def _row(hidden, t, microbatch=1, global_batch=8, ffn=None, heads=16):
    base = {c: "x" for c in mb.CHAIN_KEY}
    base.update(
        model=f"GPT-h{hidden}",
        hidden=str(hidden),
        ffn_hidden=str(4 * hidden if ffn is None else ffn),
        heads=str(heads),
        dp="1",
        microbatch=str(microbatch),
        global_batch=str(global_batch),
        measured_iter_s=str(t),
    )
    return base


def test_hidden_pairs_count_the_larger_hidden_running_faster():
    rows = [_row(1024, 1.0), _row(2048, 0.6), _row(4096, 2.0)]
    hp = mb.hidden_pairs(rows)
    assert hp["pairs"] == 3  # 1024<2048, 1024<4096, 2048<4096
    assert hp["pairs_faster_with_larger_hidden"] == 1
    assert hp["worst_row_ape_lower_bound_pct"] == pytest.approx(100 * 0.4 / 1.6)
    assert hp["worst_pair"]["models"] == ["GPT-h1024", "GPT-h2048"]


def test_hidden_pairs_need_everything_else_equal():
    rows = [
        _row(1024, 1.0),
        _row(2048, 0.5, microbatch=2),  # other microbatch: not comparable
        _row(2048, 0.5, heads=32),  # other heads: not comparable
        _row(2048, 0.5, ffn=1024),  # smaller ffn: not more work everywhere
    ]
    hp = mb.hidden_pairs(rows)
    assert hp["pairs"] == 0
    assert hp["worst_pair"] is None
