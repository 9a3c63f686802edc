"""XLA's own FLOP count of a function or of its training step, to check ``from_jax`` against.

Compiles (for the default backend; nothing runs) and reads ``cost_analysis()["flops"]``, or with
``optimized=False`` reads the same analysis of the lowered, not yet optimized module (the
operations as JAX emitted them, before XLA's passes rewrite, fuse and duplicate them). The
training step returns the outputs and the VJP of an output cotangent passed as an argument (a
step that drops its outputs lets XLA remove the last forward operations, and a constant
cotangent lets it fold multiplications by one).
"""

from __future__ import annotations

import jax

from diffcost.opgraph.trace import abstract_args, differentiated, split_call

# XLA's CPU defaults, pinned: with other code-generation options (``XLA_FLAGS``, or
# ``diffcost.cache.FAST_CPU_COMPILE``) XLA rewrites gathers' gradients differently and counts
# up to a third fewer FLOPs for the same program.
_CPU_DEFAULTS = {"xla_cpu_use_fusion_emitters": True, "xla_backend_optimization_level": 3}


def _flops(lowered, optimized: bool) -> float:
    if optimized:
        options = _CPU_DEFAULTS if jax.default_backend() == "cpu" else None
        analysis = lowered.compile(compiler_options=options).cost_analysis()
    else:
        analysis = lowered.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0]
    return float(analysis.get("flops", 0.0))


def xla_flops(
    fn, *example_args, argnums=None, backward: bool = True, optimized: bool = True
) -> float:
    """FLOPs XLA counts for ``fn(*example_args)`` (``backward``: for its forward and the
    backward w.r.t. ``argnums``, as ``from_jax`` builds them; ``optimized``: of the compiled
    module, else of the lowered one)."""
    args = tuple(abstract_args(a, f"{i} ") for i, a in enumerate(example_args))
    if not backward:
        return _flops(jax.jit(fn).lower(*args), optimized)
    wrt = differentiated(args, argnums)
    call, others = split_call(fn, args, wrt)
    diff, rest = tuple(args[i] for i in wrt), tuple(args[i] for i in others)
    out_shape = jax.eval_shape(call, diff, rest)

    def step(diff, rest, cotangent):
        out, vjp = jax.vjp(lambda *d: call(d, rest), *diff)
        return out, vjp(cotangent)

    return _flops(jax.jit(step).lower(diff, rest, out_shape), optimized)
