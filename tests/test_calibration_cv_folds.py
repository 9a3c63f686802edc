"""Cross-validation folds (calibration.cv): grouped by shape, stratified by source."""

from types import SimpleNamespace

import numpy as np

from calibration import cv


def _rows(source, n_shapes, per_shape, hidden0):
    out = []
    for i in range(n_shapes):
        model = SimpleNamespace(
            n_layers=24, hidden=hidden0 + 64 * i, ffn_hidden=0, heads=16, kv_heads=16, seq_len=2048
        )
        out += [SimpleNamespace(source_name=source, model=model) for _ in range(per_shape)]
    return out


def test_folds_keep_shapes_together_and_spread_every_source():
    # 8 large shapes of one source (like vTrain's) and 20 small ones of another
    rows = _rows("big", 8, 100, 1024) + _rows("small", 20, 3, 8192)
    fold = cv.grouped_folds(rows, 5)
    by_shape = {}
    for r, f in zip(rows, fold):
        by_shape.setdefault(cv.shape_key(r), set()).add(int(f))
    assert all(len(v) == 1 for v in by_shape.values())
    small = np.bincount(fold[[r.source_name == "small" for r in rows]], minlength=5)
    # 60 rows over 5 folds: 12 each; balancing rows alone put them all in 2 folds (30, 30)
    assert small.min() >= 9 and small.max() <= 15, small
    big = np.bincount(fold[[r.source_name == "big" for r in rows]], minlength=5)
    assert sorted(big.tolist()) == [100, 100, 200, 200, 200]
