"""Cross-validation folds over measured runs: grouped by model shape, stratified by source.

A held-out model shape must not be seen in training on any cluster, so every run of one shape
(``shape_key``) goes to one fold; and every source's runs are spread over the folds, so no
source is mostly held out at once. ``benchmarks/calibration_cv.py`` builds its folds here.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np


def shape_key(run) -> tuple:
    """The model shape of a measured run: what a fold holds out as one group.

    Args:
        run: anything with a ``model`` (``ModelSpec``: n_layers, hidden, ffn_hidden, heads,
            kv_heads, seq_len).

    Returns:
        ``(n_layers, hidden, ffn_hidden, heads, kv_heads, seq_len)``.
    """
    m = run.model
    return (m.n_layers, m.hidden, m.ffn_hidden, m.heads, m.kv_heads, m.seq_len)


def grouped_folds(runs: Sequence, k: int, seed: int = 0) -> np.ndarray:
    """Fold index per run, grouped by model shape and stratified by source.

    Groups (runs of one ``shape_key``) are shuffled with ``seed``, then, largest first, each
    goes to the fold where the sources it holds have the smallest share so far (ties: fewest
    runs). Balancing runs alone would put the 8 large vTrain shapes into the folds one by one
    and leave the few dozen shapes of every other source to whichever folds are still small:
    about half of a source held out at once.

    Args:
        runs: measured runs, each with a ``model`` and a ``source_name``.
        k: the number of folds.
        seed: seed of the shuffle that breaks ties between groups of one size.

    Returns:
        int array [len(runs)], values in ``range(k)``.
    """
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(runs):
        groups[shape_key(r)].append(i)
    names = sorted(groups)
    perm = np.random.default_rng(seed).permutation(len(names))
    order = sorted(perm, key=lambda j: -len(groups[names[j]]))  # stable: shuffled ties
    source_runs = collections.Counter(r.source_name for r in runs)
    share = collections.defaultdict(float)  # (fold, source) -> fraction of the source's runs
    fold = np.empty(len(runs), dtype=int)
    sizes = [0] * k
    for j in order:
        idx = groups[names[j]]
        here = collections.Counter(runs[i].source_name for i in idx)
        cost = [
            (max(share[f, s] + n / source_runs[s] for s, n in here.items()), sizes[f])
            for f in range(k)
        ]
        f = min(range(k), key=lambda f: cost[f])
        fold[idx] = f
        sizes[f] += len(idx)
        for s, n in here.items():
            share[f, s] += n / source_runs[s]
    return fold
