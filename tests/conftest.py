"""Numerics tests run in float64 with strict dtype promotion.

One run's processes (the xdist workers) share a JAX persistent compilation cache in a
temporary directory, so that a program one worker compiled is not compiled again by another;
the directory is made when the run starts and removed when it ends (nothing is kept between
runs nor written in the repository)."""

import os
import shutil
import tempfile

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")

CACHE_ENV = "DIFFCOST_TEST_JAX_CACHE"  # the run's cache directory, inherited by the workers
CACHE_MIN_COMPILE_S = 0.5  # programs that compile faster are not worth a file


def pytest_configure(config):
    if CACHE_ENV not in os.environ:  # the controller (or a run without xdist) makes it
        os.environ[CACHE_ENV] = config._diffcost_jax_cache = tempfile.mkdtemp(
            prefix="diffcost-jax-cache-"
        )
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)


def pytest_unconfigure(config):
    path = getattr(config, "_diffcost_jax_cache", None)
    if path is not None:
        os.environ.pop(CACHE_ENV, None)
        shutil.rmtree(path, ignore_errors=True)
