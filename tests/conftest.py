"""Numerics tests run in float64 with strict dtype promotion.

One run's processes (the xdist workers) share a JAX persistent compilation cache
(``diffcost.cache``, the command line's) in a temporary directory, so that a program one worker
compiled is not compiled again by another, and the command line run in a test writes no cache
of its own; the directory is made when the run starts and removed when it ends (nothing is kept
between runs nor written in the repository or the home folder).

XLA compiles on the CPU with ``diffcost.cache.FAST_CPU_COMPILE`` (LLVM's optimizations off, no
fusion emitters), set in ``XLA_FLAGS`` before JAX starts its backend, so the workers and the
command lines a test starts inherit it: the suite's time is mostly compiling gradients of
``simulate``, which these options halve (the library's relaxed descent compiles with them too).
They change how XLA generates the fused loops, not what they compute: results agree to rounding.

An xdist worker collects its garbage and freezes what is left at the end of its session, before
it reports back (``pytest_sessionfinish``): pytest's cleanup afterwards runs five full
collections, which over a worker's heap (a million objects, JAX's caches) took over 5 s, and
execnet interrupts a worker still running 5 s after the controller closes it (a SIGINT, printed
as a ``KeyboardInterrupt`` in ``_xla_gc_callback``)."""

import gc
import os
import shutil
import tempfile

_FAST_CPU_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0"
if _FAST_CPU_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_CPU_FLAGS}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")

from diffcost import cache  # noqa: E402  (after the numerics settings above)


def pytest_configure(config):
    if cache.ENV not in os.environ:  # the controller (or a run without xdist) makes it
        os.environ[cache.ENV] = config._diffcost_jax_cache = tempfile.mkdtemp(
            prefix="diffcost-jax-cache-"
        )
    cache.enable_compilation_cache()


def pytest_unconfigure(config):
    path = getattr(config, "_diffcost_jax_cache", None)
    if path is not None:
        os.environ.pop(cache.ENV, None)
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the module docstring says why
        gc.collect()  # pytest's hook still reports what this finalizes
        gc.freeze()  # pytest's collections after the session skip what is left
