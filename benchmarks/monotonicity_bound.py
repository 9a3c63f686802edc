"""How accurate can a cost model that never gets faster with more work be on the e2e data?

    python benchmarks/monotonicity_bound.py [--source NAME] [--data DIR] [--json]

A chain is a set of end-to-end rows that differ only in ``microbatch`` (same model shape,
cluster, precision, parallel layout, recompute, ZeRO stage and the same number of microbatches
per data-parallel rank ``global_batch / (microbatch * dp)``). In a chain a larger microbatch is
strictly more work per microbatch, so a model monotone in work (diffcost's is) predicts a time
that does not decrease with ``microbatch``. Where the measured time does decrease, every such
model misses at least one of the two rows:

* worst row: for measured ``a > b`` with ``a`` at the smaller microbatch, the best a monotone
  model can do is predict both as ``2ab / (a + b)``, an APE of ``(a - b) / (a + b)`` on both;
  the largest such value over all pairs bounds the worst-row APE of any monotone model;
* MAPE: in every chain, the non-decreasing prediction with the least summed APE (exact, by
  enumeration over the chain's measured values); summed over chains and divided by all the
  source's rows, it bounds the MAPE of any monotone model from below. Repeated measurements
  of one configuration (same chain and microbatch) count too: a model gives them one value.

A second, pairwise check: rows identical but for a larger ``hidden`` (and an ``ffn_hidden`` at
least as large; same heads, layout, microbatch and global batch) are more work in every kernel;
``hidden_pairs`` counts such pairs, how many ran faster with the larger hidden, and the worst
such pair's ``(a - b) / (a + b)``, again a bound on the worst row of any model monotone in
work (not folded into the MAPE bound).

The bounds say nothing about models that are not monotone in work (kernel selection by shape,
measurement artefacts). Pure data analysis, no fit: runs in about a second.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_rows  # noqa: E402  (a sibling script module, found however this one is loaded)

CHAIN_KEY = (
    "source", "cluster", "model", "n_layers", "hidden", "ffn_hidden", "heads", "kv_heads",
    "seq_len", "vocab", "precision", "framework", "n_gpus", "tp", "pp", "dp", "cp", "ep", "sp",
    "zero", "recompute", "interleave_chunks",
)  # fmt: skip
MAX_CHAIN = 12  # rows; longer chains are skipped by the exact L1 isotonic enumeration


def chains(rows):
    """{key: {microbatch: [measured seconds, ...]}} over rows with a microbatch and a time."""
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        try:
            mb, gb, dp = int(r["microbatch"]), int(r["global_batch"]), int(r["dp"])
            t = float(r["measured_iter_s"])
        except ValueError:
            continue
        if mb <= 0 or dp <= 0 or t <= 0 or gb % (mb * dp):
            continue
        key = tuple(r[c] for c in CHAIN_KEY) + (gb // (mb * dp),)
        out[key][mb].append(t)
    return out


def _isotonic_l1(groups):
    """One log-time per group, non-decreasing over the groups, minimizing the summed APE
    ``|exp(value - y) - 1|`` over every log-time y of every group (a weighted L1 isotonic
    regression in linear time: its optimum lies on the measured values). Returns the values."""
    cands = sorted({y for g in groups for y in g})
    best = None
    for vals in itertools.combinations_with_replacement(cands, len(groups)):
        err = sum(abs(math.exp(v - y) - 1.0) for v, g in zip(vals, groups) for y in g)
        if best is None or err < best[0]:
            best = (err, vals)
    return best[1]


HIDDEN_KEY = tuple(c for c in CHAIN_KEY if c not in ("model", "hidden", "ffn_hidden")) + (
    "microbatch", "global_batch",
)  # fmt: skip


def hidden_pairs(rows) -> dict:
    """Pairs of rows that differ only in a larger hidden (and ffn_hidden not smaller)."""
    groups = collections.defaultdict(list)
    for r in rows:
        try:
            h, f, t = int(r["hidden"]), int(r["ffn_hidden"] or 0), float(r["measured_iter_s"])
        except ValueError:
            continue
        if t > 0:
            groups[tuple(r[c] for c in HIDDEN_KEY)].append((h, f, t, r["model"]))
    pairs = faster = 0
    worst = (0.0, None)
    for key, pts in groups.items():
        for (ha, fa, a, ma), (hb, fb, b, mb) in itertools.permutations(pts, 2):
            if hb > ha and fb >= fa:
                pairs += 1
                if b < a:
                    faster += 1
                    if (a - b) / (a + b) > worst[0]:
                        worst = ((a - b) / (a + b), {"key": key, "models": [ma, mb], "s": [a, b]})
    return {
        "pairs": pairs,
        "pairs_faster_with_larger_hidden": faster,
        "worst_row_ape_lower_bound_pct": 100.0 * worst[0],
        "worst_pair": worst[1],
    }


def bounds(rows) -> dict:
    """Monotone-model bounds over the chains of ``rows`` (one source)."""
    pairs = violating = 0
    worst = (0.0, None)
    ape_sum, n_rows, skipped = 0.0, 0, 0
    for key, by_mb in chains(rows).items():
        # repeated measurements of one microbatch are separate rows at the same x
        pts = sorted((mb, t) for mb, ts in by_mb.items() for t in ts)
        for (mb_a, a), (mb_b, b) in itertools.combinations(pts, 2):
            if mb_b > mb_a:
                pairs += 1
                if b < a:
                    violating += 1
                    if (a - b) / (a + b) > worst[0]:
                        worst = ((a - b) / (a + b), {"chain": key, "mb": [mb_a, mb_b], "s": [a, b]})
        if len(pts) < 2:
            continue
        if len(pts) > MAX_CHAIN:
            skipped += len(pts)
            continue
        groups = [[math.log(t) for t in by_mb[mb]] for mb in sorted(by_mb)]
        fit = _isotonic_l1(groups)
        ape_sum += sum(abs(math.exp(v - y) - 1.0) for v, g in zip(fit, groups) for y in g)
        n_rows += len(pts)
    return {
        "rows_in_chains": n_rows,
        "rows_skipped_long_chains": skipped,
        "microbatch_pairs": pairs,
        "pairs_faster_with_larger_microbatch": violating,
        "rows": len(rows),
        "mape_lower_bound_pct": 100.0 * ape_sum / max(len(rows), 1),
        "worst_row_ape_lower_bound_pct": 100.0 * worst[0],
        "worst_pair": worst[1],
        "hidden_pairs": hidden_pairs(rows),
    }


def main(argv=None) -> int:
    args = e2e_rows.parse(__doc__, argv)
    rows = e2e_rows.rows(args)
    if rows is None:
        return 2
    by_source = collections.defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    names = [args.source] if args.source else sorted(by_source)
    result = {s: bounds(by_source[s]) for s in names}
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    print(f"{'source':34s} {'rows':>5s} {'pairs':>6s} {'faster':>6s} {'MAPE>=':>7s} {'max>=':>6s}")
    for s, b in result.items():
        print(
            f"{s:34s} {b['rows']:5d} {b['microbatch_pairs']:6d} "
            f"{b['pairs_faster_with_larger_microbatch']:6d} {b['mape_lower_bound_pct']:6.2f}% "
            f"{b['worst_row_ape_lower_bound_pct']:5.1f}%"
        )
        if b["worst_pair"]:
            w = b["worst_pair"]
            shape = dict(zip(CHAIN_KEY + ("microbatches",), w["chain"]))
            print(
                f"    worst: {shape['model']} tp={shape['tp']} pp={shape['pp']} dp={shape['dp']} "
                f"{shape['microbatches']} microbatches: microbatch {w['mb'][0]} -> {w['mb'][1]}: "
                f"{w['s'][0]:.3f} s -> {w['s'][1]:.3f} s"
            )
        hp = b["hidden_pairs"]
        if hp["pairs"]:
            print(
                f"    rows differing only in a larger hidden: {hp['pairs']} pairs, "
                f"{hp['pairs_faster_with_larger_hidden']} ran faster with the larger hidden; "
                f"worst-row bound from them {hp['worst_row_ape_lower_bound_pct']:.1f}%"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
