"""Numerics tests run in float64 with strict dtype promotion.

One run's processes (the xdist workers) share a JAX persistent compilation cache
(``diffcost.cache``, the command line's) in a temporary directory, so that a program one worker
compiled is not compiled again by another, and the command line run in a test writes no cache
of its own; the directory is made when the run starts and removed when it ends (nothing is kept
between runs nor written in the repository or the home folder)."""

import os
import shutil
import tempfile

import jax

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
