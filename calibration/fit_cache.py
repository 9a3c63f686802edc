"""Fits of a held-out study kept on disk, so a later run of the same study reuses them.

A zero-shot fit of ``benchmarks/transfer.py`` takes minutes; its suggested-runs and few-shot
parts, and a rerun after a change to the report alone, need the same fits again. ``FitCache``
stores each fit's raw (device, cluster) tables and row weights under a key that changes with
anything the fit depends on: the held-out mask, the ``FitConfig``, the shared data files (name,
size, modification time) and the source of the ``diffcost`` and ``calibration`` packages with
their shipped configs. A changed line of the model or a new data file therefore misses the
cache and fits again; nothing is ever invalidated by hand.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np

PACKAGES = ("diffcost", "calibration")
SUFFIXES = (".py", ".yaml", ".yml", ".json", ".csv")


def _tree_digest(root: Path) -> str:
    """Hash of every source and config file of the packages under ``root``."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*")):
            if path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _data_digest(data_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(Path(data_dir).rglob("*")):
        if path.is_file():
            st = path.stat()
            h.update(f"{path.relative_to(data_dir)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


class FitCache:
    """``get(mask, cfg)`` / ``put(mask, cfg, value)`` of picklable fit results in ``folder``
    (created when first written); ``folder=None`` caches nothing."""

    def __init__(self, folder: str | Path | None, root: Path, data_dir: Path):
        self.folder = Path(folder) if folder else None
        self.base = _tree_digest(root) + _data_digest(data_dir) if self.folder else ""

    def key(self, mask: np.ndarray, cfg) -> str:
        h = hashlib.sha256(self.base.encode())
        h.update(np.asarray(mask, dtype=bool).tobytes())
        h.update(repr(cfg).encode())
        return h.hexdigest()[:24]

    def get(self, mask: np.ndarray, cfg):
        if self.folder is None:
            return None
        path = self.folder / f"{self.key(mask, cfg)}.pkl"
        if not path.exists():
            return None
        with path.open("rb") as f:
            return pickle.load(f)

    def put(self, mask: np.ndarray, cfg, value) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.key(mask, cfg)}.pkl"
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            pickle.dump(value, f)
        tmp.replace(path)
