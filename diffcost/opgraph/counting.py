"""FLOPs, bytes and kind of one JAX primitive application, by XLA's counting convention.

FLOPs follow XLA's ``HloCostAnalysis`` (what ``jax.jit(f).lower(...).compile().cost_analysis()``
reports): a dot product is ``2 x output elements x contracted size``; a convolution ``2 x
batch x in features / groups x out features x`` the number of (output position, kernel tap)
pairs that land inside the (dilated) input, per spatial dimension (padding taps are free); an
elementwise operation one FLOP per output element, except transcendental ones (exp, log, tanh,
logistic, erf, sqrt, rsqrt, pow, trigonometric), which are counted apart; a reduction one FLOP
per input element beyond the output's; reshapes, broadcasts, transposes, slices, pads,
concatenations, gathers and iota none (a ``FILL_OR_DROP`` gather, as JAX lowers it, adds its
bounds mask and a select per element: ``_fill_or_drop_flops``). Bytes: every input read once
and every output written once, except gathers and slices, which read only what they return.

``cost`` raises ``UnsupportedPrimitiveError`` (naming the primitive and the supported ones) for
a primitive it has no rule for.

References:
    openxla/xla ``xla/service/hlo_cost_analysis.cc`` (HandleElementwiseOp, GetDotFlops,
    GetConvolutionFlops, HandleReduce, HandleReduceWindow, HandleSelectAndScatter).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

TRANSCENDENTAL = frozenset(
    "exp exp2 log log1p expm1 tanh logistic erf erfc erf_inv sqrt rsqrt cbrt pow sin cos tan "
    "asin acos atan atan2 sinh cosh asinh acosh atanh lgamma digamma".split()
)
ELEMENTWISE = frozenset(
    "add add_any sub mul div rem neg abs sign max min floor ceil round nextafter is_finite "
    "eq ne lt le gt ge and or not xor select_n clamp convert_element_type square "
    "shift_left shift_right_logical shift_right_arithmetic population_count clz imag real "
    "conj complex reduce_precision integer_pow".split()
)
REDUCTION = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin "
    "cumsum cumprod cummax cummin cumlogsumexp".split()
)
WINDOWED = frozenset(
    "reduce_window_sum reduce_window_max reduce_window_min select_and_gather_add "
    "select_and_scatter_add".split()
)
LAYOUT = frozenset(
    "reshape broadcast_in_dim squeeze expand_dims transpose rev slice pad concatenate iota "
    "copy copy_p dynamic_slice dynamic_update_slice split stack unstack sharding_constraint "
    "optimization_barrier stop_gradient".split()
)
# Axis mappings of layout primitives that sharding needs (transpose, broadcast_in_dim).
_AXIS_MAPS = ("permutation", "broadcast_dimensions")
# Window shapes of windowed reductions (axes with a window and stride of 1 may be split).
_WINDOW_ATTRS = ("window_dimensions", "window_strides")
GATHER = frozenset("gather scatter scatter-add scatter_add scatter-mul scatter_mul".split())
COLLECTIVE = frozenset(
    "psum all_gather all_to_all ppermute psum_scatter reduce_scatter pmax pmin".split()
)
CONTRACTION = frozenset(("dot_general", "conv_general_dilated"))
SUPPORTED = (
    TRANSCENDENTAL | ELEMENTWISE | REDUCTION | WINDOWED | LAYOUT | GATHER | COLLECTIVE | CONTRACTION
)
# Reads only the returned part of their first operand.
_PARTIAL_READ = frozenset(("gather", "slice", "dynamic_slice"))


class UnsupportedPrimitiveError(NotImplementedError):
    """A primitive ``from_jax`` has no cost rule for."""


@dataclasses.dataclass(frozen=True)
class OpCost:
    kind: str
    flops: float
    transcendentals: float
    bytes_read: float
    bytes_written: float
    gemm: tuple[int, int, int, int] | None = None
    attributes: tuple[tuple[str, object], ...] = ()


def aval_bytes(aval) -> int:
    """Bytes of an abstract array (0 for tokens and other non-arrays)."""
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    return math.prod(shape) * np.dtype(aval.dtype).itemsize


def _size(aval) -> int:
    return math.prod(getattr(aval, "shape", ()))


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED))


def _dot_cost(in_avals, out_aval, params) -> tuple[float, tuple, tuple]:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs = in_avals[0].shape, in_avals[1].shape
    batch = math.prod(lhs[d] for d in lb)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
    flops = 2.0 * _size(out_aval) * k
    attrs = (("dimension_numbers", ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))),)
    return flops, (batch, m, n, k), attrs


def _valid_positions(inp, kernel, out, stride, pad_lo, lhs_dil, rhs_dil) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read a real input
    element: not padding, not a hole of the input's dilation."""
    o = np.arange(out)[:, None]
    t = np.arange(kernel)[None, :]
    pos = o * stride - pad_lo + t * rhs_dil
    real = (pos >= 0) & (pos % lhs_dil == 0) & (pos // lhs_dil < inp)
    return int(np.count_nonzero(real))


def _conv_cost(in_avals, out_aval, params) -> tuple[float, tuple, tuple]:
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs, out = in_avals[0].shape, in_avals[1].shape, out_aval.shape
    fgc, bgc = params["feature_group_count"], params["batch_group_count"]
    n_sp = len(lhs_spec) - 2
    lhs_dil = params.get("lhs_dilation") or (1,) * n_sp
    rhs_dil = params.get("rhs_dilation") or (1,) * n_sp
    positions, taps, out_spatial = 1, 1, 1
    for i in range(n_sp):
        size_in, size_k = lhs[lhs_spec[2 + i]], rhs[rhs_spec[2 + i]]
        size_out = out[out_spec[2 + i]]
        positions *= _valid_positions(
            size_in,
            size_k,
            size_out,
            params["window_strides"][i],
            params["padding"][i][0],
            lhs_dil[i],
            rhs_dil[i],
        )
        taps *= size_k
        out_spatial *= size_out
    batch, in_feat = lhs[lhs_spec[0]], lhs[lhs_spec[1]]
    out_feat = out[out_spec[1]]
    fma = (in_feat // fgc) * out_feat * (batch // bgc) * positions
    groups = fgc * bgc
    m = (batch // bgc) * out_spatial
    n = out_feat // groups
    k = fma / max(groups * m * n, 1)  # the implicit GEMM's depth without the padding taps
    attrs = (
        ("dimension_numbers", (tuple(lhs_spec), tuple(rhs_spec), tuple(out_spec))),
        ("feature_group_count", fgc),
        ("batch_group_count", bgc),
        ("kernel_taps", taps),
    )
    return 2.0 * fma, (groups, m, n, k), attrs


def _window_cost(name, in_avals, out_avals, params) -> float:
    window = math.prod(params.get("window_dimensions", (1,)))
    if name == "select_and_scatter_add":  # source: operand 0; select: compare, scatter: add
        source = _size(in_avals[0])
        return float(source * (window - 1) + source)
    return float((window - 1) * _size(out_avals[0]))


def _integer_pow_flops(y: int) -> int:
    """Multiplies of ``x ** y`` by repeated squaring (plus the reciprocal of a negative y)."""
    e = abs(int(y))
    if e == 0:
        return 0
    return e.bit_length() - 1 + bin(e).count("1") - 1 + (1 if y < 0 else 0)


def _fill_or_drop_flops(indices, out_size: float) -> float:
    """A gather in ``FILL_OR_DROP`` mode (``jnp.take``'s default) is lowered with a bounds mask:
    two compares and an ``and`` per index component, an ``and``-reduction over each index
    vector, and a select between the gathered value and the fill value per output element."""
    shape = indices.shape
    vector = shape[-1] if shape else 1
    tuples = math.prod(shape[:-1]) if shape else 1
    return float(tuples * (3 * vector + vector - 1) + out_size)


def _bytes(name, in_avals, out_avals) -> tuple[float, float]:
    written = float(sum(aval_bytes(a) for a in out_avals))
    if name in _PARTIAL_READ:
        rest = sum(aval_bytes(a) for a in in_avals[1:])
        return written + rest, written
    if name in ("scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul"):
        updates = aval_bytes(in_avals[2]) if len(in_avals) > 2 else 0
        index = aval_bytes(in_avals[1]) if len(in_avals) > 1 else 0
        return float(2 * updates + index), float(updates)
    if name == "dynamic_update_slice":
        update = aval_bytes(in_avals[1])
        return float(update), float(update)
    return float(sum(aval_bytes(a) for a in in_avals)), written


def cost(name: str, in_avals, out_avals, params) -> OpCost:
    """Kind, FLOPs, transcendentals and bytes of primitive ``name`` applied to abstract
    arrays ``in_avals`` giving ``out_avals`` with equation ``params``.

    Raises:
        UnsupportedPrimitiveError: ``name`` has no rule here.
    """
    read, written = _bytes(name, in_avals, out_avals)
    out_size = float(sum(_size(a) for a in out_avals))
    flops, transcendentals, gemm, attrs = 0.0, 0.0, None, ()
    if name == "dot_general":
        kind = "matmul"
        flops, gemm, attrs = _dot_cost(in_avals, out_avals[0], params)
    elif name == "conv_general_dilated":
        kind = "convolution"
        flops, gemm, attrs = _conv_cost(in_avals, out_avals[0], params)
    elif name in TRANSCENDENTAL:
        kind, transcendentals = "elementwise", out_size
    elif name == "integer_pow":
        kind, flops = "elementwise", out_size * _integer_pow_flops(params["y"])
    elif name in ELEMENTWISE:
        kind, flops = "elementwise", out_size
    elif name in REDUCTION:
        kind = "reduction"
        flops = float(max(_size(in_avals[0]) - _size(out_avals[0]), 0))
        attrs = (("axes", tuple(params.get("axes", ()))),)
    elif name in WINDOWED:
        kind, flops = "reduction", _window_cost(name, in_avals, out_avals, params)
        attrs = tuple((k, tuple(params[k])) for k in _WINDOW_ATTRS if k in params)
    elif name in LAYOUT:
        kind = "layout"
        attrs = tuple((k, tuple(params[k])) for k in _AXIS_MAPS if k in params)
    elif name in GATHER:
        kind = "gather"
        if name == "gather" and "FILL_OR_DROP" in str(params.get("mode", "")):
            flops = _fill_or_drop_flops(in_avals[1], out_size)
        elif name != "scatter" and name != "gather":  # one combiner step per update element
            flops = float(_size(in_avals[2]))
    elif name in COLLECTIVE:
        kind = "collective"
        attrs = (("axis_name", str(params.get("axis_name", params.get("axes", "")))),)
    else:
        raise UnsupportedPrimitiveError(
            f"from_jax: no cost rule for the JAX primitive {name!r}. Supported primitives: "
            f"{supported_list()}; higher-order ones (pjit, closed_call, custom_jvp_call, "
            f"custom_vjp_call, checkpoint/remat, scan, while, cond, shard_map) are walked "
            f"into."
        )
    return OpCost(kind, flops, transcendentals, read, written, gemm, attrs)
