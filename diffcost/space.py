"""The discrete plan space of a model on a GPU count: its rules, its members, their arrays.

A ``Space`` fixes what a search or a sweep may choose from: the model, the cluster, the GPU count
and global batch, and the menus (microbatch sizes, interleaving depths, the largest context
parallel degree, the rank orders). A ``Choice`` is one discrete plan in it. ``enumerate_plans``
lists every valid choice directly as a batched ``PlanArrays`` (numpy leaves, leading axis =
configuration), so that millions of them cost no Python objects each; ``to_arrays`` does the
same for any list of choices (the candidates of a search).

Valid means: the choice satisfies every rule of ``diffcost.constraints`` (the table that
``config.check_plan`` and ``simulate.plan_is_valid`` evaluate too) and takes its values from the
space's menus. The enumeration checks each rule as soon as the degrees, microbatch size and
schedule it reads are chosen. The parallel degrees are in ``PLACED_DIMS`` order (tp, cp, dp, pp)
in a ``Choice`` and in a degree tuple.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import typing
from typing import NamedTuple

import numpy as np

from diffcost import constraints
from diffcost.arrays import PlanArrays, lora_leaves
from diffcost.config import ConfigError
from diffcost.constraints import divisors, join
from diffcost.specs import (
    PLACED_DIMS,
    RECOMPUTE_MODES,
    SCHEDULES,
    ZERO_STAGES,
    ClusterSpec,
    ModelSpec,
    ParamGather,
    PlanSpec,
)

# Rank orders (innermost first) that Megatron-Core's rank generator offers: the default
# tp-cp-ep-dp-pp, and tp-cp-ep-pp-dp (``--use-tp-pp-dp-mapping``).
ORDERS = (("tp", "cp", "dp", "pp"), ("tp", "cp", "pp", "dp"))
_RECOMPUTE_SHORT = {"none": "norc", "selective": "sel", "full": "full"}


def _placed(order: tuple[str, ...], sizes: dict) -> tuple[str, ...]:
    """The dimensions of ``order`` that take a place at the degrees ``sizes`` (placed
    dimension -> degree): those larger than 1."""
    return tuple(d for d in order if sizes[d] > 1)


class Choice(NamedTuple):
    """One discrete plan of a ``Space`` (hashable; ``order`` indexes ``Space.orders``)."""

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    microbatch: int
    schedule: str
    chunks: int  # 1 unless interleaved
    recompute: str
    zero: int
    order: int

    def label(self, space: Space) -> str:
        """A compact description, e.g. ``"tp8 pp8 dp16 mb1 1f1b zero1 sel"``.

        cp and ep appear when above 1, the interleaving depth as ``interleaved-v4``, recompute
        as ``norc`` / ``sel`` / ``full``, and the rank order when it is not the default.
        """
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        parts += [f"cp{self.cp}"] * (self.cp > 1) + [f"ep{self.ep}"] * (self.ep > 1)
        parts.append(f"mb{self.microbatch}")
        interleaved = self.schedule == "interleaved"
        parts.append(f"interleaved-v{self.chunks}" if interleaved else self.schedule)
        parts += [f"zero{self.zero}", _RECOMPUTE_SHORT[self.recompute]]
        if self.order != 0:
            parts.append("order " + "-".join(space.orders[self.order]))
        return " ".join(parts)

    def describe(self, space: Space) -> dict:
        """The choice as a plain dict (order spelled out), for tables, JSON and CSV."""
        d = self._asdict()
        d["order"] = "-".join(space.orders[self.order])
        return d


@dataclasses.dataclass(frozen=True)
class Space:
    """What a search or sweep chooses from (see the module docstring for validity)."""

    model: ModelSpec
    cluster: ClusterSpec
    n_gpus: int
    global_batch: int
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16)
    chunks: tuple[int, ...] = (2, 3, 4, 6, 8)
    max_cp: int = 8
    orders: tuple[tuple[str, ...], ...] = ORDERS
    sequence_parallel: bool = True  # whenever tp > 1
    overlap_dp: bool = True
    overlap_tp: bool = False
    grad_reduce_fp32: bool = True
    param_gather: ParamGather = "step"  # ``PlanSpec.param_gather`` of the ZeRO-2 choices
    lora_rank: int | None = None  # LoRA fine-tuning (``PlanSpec.lora_rank``), fixed for all
    lora_modules: str = "attention"

    # --- the rules -----------------------------------------------------------------------
    @functools.cached_property
    def _request(self) -> dict:
        """The quantities (``diffcost.constraints``) the space fixes before any choice."""
        return constraints.request_quantities(
            self.model, self.cluster, self.n_gpus, self.global_batch
        )

    def structural_splits(self) -> list[tuple[int, int, int, int]]:
        """(tp, cp, dp, pp) with ``tp*cp*dp*pp == n_gpus`` and cp <= max_cp that satisfy every
        rule on the degrees alone, with one chunk per stage (the global batch not consulted)."""
        n, ok = self.n_gpus, constraints.holds
        base = {**self._request, "chunks": 1, "interleaved": 0}
        if not ok(base):
            return []
        out = []
        for tp in divisors(n):
            with_tp = {**base, "tp": tp}
            if not ok(with_tp, ["tp"]):
                continue
            for pp in divisors(n // tp):
                with_pp = {**with_tp, "pp": pp}
                if not ok(with_pp, ["pp"]):
                    continue
                for cp in divisors(n // (tp * pp)):
                    dp = n // (tp * pp * cp)
                    if cp <= self.max_cp and ok({**with_pp, "cp": cp, "dp": dp}, ["cp", "dp"]):
                        out.append((tp, cp, dp, pp))
        return out

    def degree_tuples(self) -> list[tuple[int, int, int, int]]:
        """The structural splits (tp, cp, dp, pp) with at least one valid microbatch size."""
        return [t for t in self.structural_splits() if self.microbatch_choices(t[2])]

    @functools.cached_property
    def _menus(self) -> dict:
        """Menus already worked out, by (method, arguments): a search asks for the same few
        thousands of times while it rounds relaxed plans."""
        return {}

    def _menu(self, key: tuple, build) -> list:
        if key not in self._menus:
            self._menus[key] = tuple(build())
        return list(self._menus[key])

    def microbatch_choices(self, dp: int) -> list[int]:
        """The menu's microbatch sizes that the rules allow with ``dp`` data-parallel ranks."""
        return self._menu(("microbatch", dp), lambda: self._microbatch_choices(dp))

    def ep_choices(self, dp: int) -> list[int]:
        """The expert-parallel degrees the rules allow with ``dp`` data-parallel ranks."""
        return self._menu(("ep", dp), lambda: self._ep_choices(dp))

    def schedules(self, pp: int, n_micro: int) -> list[tuple[str, int]]:
        """(schedule, chunks) pairs valid for ``pp`` stages and ``n_micro`` microbatches.

        GPipe is left out for one stage, where it is the same schedule as 1F1B.
        """
        return self._menu(("schedule", pp, n_micro), lambda: self._schedules(pp, n_micro))

    def _microbatch_choices(self, dp: int) -> list[int]:
        q = {**self._request, "dp": dp}
        menu = self.microbatches
        return [mb for mb in menu if constraints.holds({**q, "microbatch": mb}, ["microbatch"])]

    def _ep_choices(self, dp: int) -> list[int]:
        q = {**self._request, "dp": dp}
        return [e for e in divisors(dp) if constraints.holds({**q, "ep": e}, ["ep"])]

    def _schedules(self, pp: int, n_micro: int) -> list[tuple[str, int]]:
        q = {**self._request, "pp": pp, "n_microbatches": n_micro}
        options = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)]
        options += [("interleaved", v) for v in self.chunks]
        return [
            (name, v)
            for name, v in options
            if constraints.holds(
                {**q, "chunks": v, "interleaved": int(name == "interleaved")},
                ["chunks", "interleaved"],
            )
        ]

    def is_valid(self, c: Choice) -> bool:
        """True when ``c`` satisfies every rule and takes its values from the menus."""
        if min(c.tp, c.cp, c.dp, c.pp, c.ep, c.microbatch) <= 0 or c.cp > self.max_cp:
            return False
        in_menus = (
            c.microbatch in self.microbatches
            and c.recompute in RECOMPUTE_MODES
            and c.zero in ZERO_STAGES
            and c.order in self.distinct_orders(c._asdict())
        )
        q = constraints.spec_quantities(self.model, self.cluster, self.plan_spec(c), self.n_gpus)
        return (
            in_menus
            and constraints.holds(q)
            and (c.schedule, c.chunks) in self.schedules(c.pp, q["n_microbatches"])
        )

    def distinct_orders(self, sizes: dict) -> list[int]:
        """Indexes of ``orders`` that place the ranks differently at the degrees ``sizes``
        (placed dimension -> degree, e.g. ``choice._asdict()``; a dimension of size 1 takes no
        place): the first of each set of equivalent orders."""
        first = {}
        for i, order in enumerate(self.orders):
            first.setdefault(_placed(order, sizes), i)
        return sorted(first.values())

    def canonical(self, c: Choice) -> Choice:
        """``c`` with its rank order replaced by the first order that places its ranks alike
        (``distinct_orders``): two plans that differ only in equivalent orders are one."""
        if not 0 <= c.order < len(self.orders):
            return c
        sizes = c._asdict()
        placed = _placed(self.orders[c.order], sizes)
        return c._replace(
            order=next(i for i, o in enumerate(self.orders) if _placed(o, sizes) == placed)
        )

    def choices(self) -> list[Choice]:
        """Every valid choice, degrees outermost; one rank order of those that place the
        ranks alike (``distinct_orders``)."""
        out = []
        with _gc_paused():
            for tp, cp, dp, pp in self.degree_tuples():
                eps = self.ep_choices(dp)
                orders = self.distinct_orders({"tp": tp, "cp": cp, "dp": dp, "pp": pp})
                for mb in self.microbatch_choices(dp):
                    n_micro = self.global_batch // (dp * mb)
                    for ep, (sched, v), rec, zero, order in itertools.product(
                        eps, self.schedules(pp, n_micro), RECOMPUTE_MODES, ZERO_STAGES, orders
                    ):
                        out.append(Choice(tp, cp, dp, pp, ep, mb, sched, v, rec, zero, order))
        return out

    # --- conversions -----------------------------------------------------------------------
    def plan_spec(self, c: Choice) -> PlanSpec:
        return PlanSpec(
            tp=c.tp,
            pp=c.pp,
            dp=c.dp,
            cp=c.cp,
            ep=c.ep,
            sequence_parallel=self.sequence_parallel and c.tp > 1,
            zero=c.zero,
            param_gather=self.param_gather if c.zero == 2 else "step",
            recompute=c.recompute,
            microbatch=c.microbatch,
            global_batch=self.global_batch,
            schedule=c.schedule,
            chunks=c.chunks,
            overlap_dp=self.overlap_dp,
            overlap_tp=self.overlap_tp,
            grad_reduce_fp32=self.grad_reduce_fp32,
            order=self.orders[c.order],
            lora_rank=self.lora_rank,
            lora_modules=self.lora_modules,
        )

    def to_arrays(self, choices: list[Choice]) -> PlanArrays:
        """Batched ``PlanArrays`` (numpy float64 leaves) of ``choices``, in their order."""
        n = len(choices)
        with _gc_paused():
            cols = list(zip(*choices)) if n else [()] * len(Choice._fields)
        c = dict(zip(Choice._fields, cols))
        f = lambda key: np.fromiter(c[key], dtype=float, count=n)  # noqa: E731

        def index(key, menu):
            return np.fromiter(map({v: i for i, v in enumerate(menu)}.__getitem__, c[key]), int, n)

        def one_hot(key, menu):
            return np.eye(len(menu))[index(key, menu)]

        ranks = np.array([[o.index(d) for d in PLACED_DIMS] for o in self.orders], dtype=float)
        tp = f("tp")
        return PlanArrays(
            tp=tp,
            pp=f("pp"),
            dp=f("dp"),
            cp=f("cp"),
            ep=f("ep"),
            microbatch=f("microbatch"),
            global_batch=np.full(n, float(self.global_batch)),
            chunks=f("chunks"),
            split_edges=np.zeros(n),  # the plain split of the layers
            sp=np.where(tp > 1, float(self.sequence_parallel), 0.0),
            overlap_dp=np.full(n, float(self.overlap_dp)),
            overlap_tp=np.full(n, float(self.overlap_tp)),
            grad_reduce_fp32=np.full(n, float(self.grad_reduce_fp32)),
            zero=one_hot("zero", ZERO_STAGES),
            gather_layer=np.full(n, float(self.param_gather == "layer")),
            recompute=one_hot("recompute", RECOMPUTE_MODES),
            offload=np.zeros(n),  # activations stay on the GPU
            schedule=one_hot("schedule", SCHEDULES),
            order=ranks[index("order", range(len(self.orders)))],
            **lora_leaves(self.lora_rank, self.lora_modules, lambda v: np.asarray(v, float), n),
        )


@contextlib.contextmanager
def _gc_paused():
    """Building ~1e5 small tuples triggers Python's cyclic GC again and again (2-3x slower,
    and erratic); they hold no cycles, so pause it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def make_space(
    model: ModelSpec, cluster: ClusterSpec, n_gpus: int, global_batch: int, **menus
) -> Space:
    """A ``Space``, or a ``ConfigError`` saying why the request has no valid plan at all."""
    space = Space(model, cluster, int(n_gpus), int(global_batch), **menus)
    if space.param_gather not in typing.get_args(ParamGather):
        raise ConfigError(
            f"param_gather={space.param_gather!r}: expected 'step' (ZeRO-2 gathers after the "
            "optimizer step, DeepSpeed) or 'layer' (per layer before its forward, FSDP "
            "SHARD_GRAD_OP)"
        )
    if n_gpus < 1:
        raise ConfigError(f"gpus={n_gpus}: need at least 1 GPU")
    if global_batch < 1:
        raise ConfigError(f"global_batch={global_batch}: need at least 1 sequence")
    problems = constraints.request_problems(model, cluster, n_gpus, global_batch)
    if problems:
        raise ConfigError(f"{model.name} on gpus={n_gpus}: " + "; ".join(problems))
    if not space.degree_tuples():
        raise ConfigError(_why_empty(space))
    return space


def _why_empty(space: Space) -> str:
    m, n, gb = space.model, space.n_gpus, space.global_batch
    dps = {dp for _, _, dp, _ in space.structural_splits()}
    return (
        f"no valid plan for {m.name} on gpus={n} with global_batch={gb}: the splits "
        f"tp*pp*cp*dp = {n} allowed by heads={m.heads}, kv_heads={m.kv_heads}, "
        f"n_layers={m.n_layers} and cp <= {space.max_cp} leave dp in {{{join(sorted(dps))}}}, "
        f"and no dp * microbatch (microbatch from {join(space.microbatches)}) divides "
        f"global_batch={gb}; choose a global_batch that is a multiple of one of those dp "
        "values, or another GPU count"
    )


def enumerate_plans(space: Space) -> tuple[PlanArrays, list[Choice]]:
    """Every valid choice of ``space``: (batched PlanArrays with numpy leaves, the choices)."""
    choices = space.choices()
    return space.to_arrays(choices), choices


def load_space(
    model: str,
    cluster: str,
    gpus: int,
    global_batch: int,
    seq: int | None = None,
    **menus,
) -> Space:
    """``make_space`` from preset names or YAML paths (``seq`` overrides the model's seq_len)."""
    from diffcost import config

    model_spec = config.load_model(model, {"seq_len": seq} if seq else None)
    return make_space(model_spec, config.load_cluster(cluster), gpus, global_batch, **menus)
