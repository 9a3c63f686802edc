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
