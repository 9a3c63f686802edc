"""JAX's persistent compilation cache for the command line (not for library imports).

Compiling ``simulate`` and its gradient takes seconds to a minute on a CPU; the cache keeps
the compiled programs on disk so the next run of the same command starts at once. The folder
is ``$DIFFCOST_CACHE_DIR`` or ``~/.cache/diffcost/jax``; set ``DIFFCOST_CACHE_DIR=off`` to
disable it.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "DIFFCOST_CACHE_DIR"


def enable_compilation_cache() -> str | None:
    """Turn the cache on (idempotent); returns the folder, or None when disabled."""
    folder = os.environ.get(ENV, str(Path.home() / ".cache" / "diffcost" / "jax"))
    if folder.lower() == "off":
        return None
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return folder


# Reverse passes of ``simulate`` are ~1,000 fusions; XLA:CPU's default pipeline compiles them in
# ~30-90 s on a small machine, these options in a third of that. Measured on the relaxed plan
# descent (benchmarks/search.py's GPT-3 case), the program also ran faster with them (0.25 s
# against 0.38 s), so they are not only a compile-time trade.
FAST_CPU_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
# For a program run hundreds of times, the default optimization level without the fusion
# emitters: the calibration fit's step on every shared run (1,790 end-to-end rows) compiled in
# 69 s against 44 s and stepped in 0.12 s against 0.49 s; a 600-step fit took 253 s against
# 448 s, with the same loss to 6 digits (2 cores, load 6).
STEADY_CPU_COMPILE = {"xla_cpu_use_fusion_emitters": False}
_XLA_ERROR = getattr(jax.errors, "JaxRuntimeError", RuntimeError)


def fast_compile_jit(fn, cpu_options: dict | None = None, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)`` compiled with ``cpu_options`` (default
    ``FAST_CPU_COMPILE``) on the CPU.

    Falls back to the default options on other backends, or when this JAX/XLA does not know
    the options.
    """
    options = FAST_CPU_COMPILE if cpu_options is None else cpu_options
    fast = jax.jit(fn, compiler_options=options, **jit_kwargs)
    plain = jax.jit(fn, **jit_kwargs)
    state = {"fast": True}

    def call(*args, **kwargs):
        if state["fast"] and jax.default_backend() == "cpu":
            try:
                return fast(*args, **kwargs)
            except (TypeError, _XLA_ERROR):
                state["fast"] = False
        return plain(*args, **kwargs)

    call.fast, call.plain = fast, plain
    return call
