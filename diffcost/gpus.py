"""GPU families: the key a GPU description reduces to, and the preset that stands for each.

Calibrated device constants are shared by every cluster with GPUs of one family (``"h100"``,
``"a100"``, ``"mi350"``, ...); this module says which family a GPU name or a cluster preset
belongs to.
"""

from __future__ import annotations

import re

import numpy as np

from diffcost import config

_GPU_RE = re.compile(r"(?<![a-z0-9])(gb\d{3}|gh\d{3}|mi\d{3}|[abhlvt]\d{2,3})", re.IGNORECASE)

# A cluster preset whose GPU facts stand for a GPU family in kernel-only measurements.
FAMILY_CLUSTER = {
    "h100": "generic-h100",
    "h200": "dgx-h200",  # the one H200 preset
    "b200": "generic-b200",
    "mi350": "generic-mi350",
    "a100": "generic-a100-80g",
    "v100": "generic-v100",
    "gb200": "generic-gb200-nvl72",
    "gb300": "generic-gb300-nvl72",
}
# A GPU family's nearest relative of the same architecture (the same compute die or its
# generation): where data say nothing about one of a family's device constants, calibration
# draws it toward the relative's (``calibration.fit``'s prior), and a family without a
# calibrated profile predicts with the relative's (``diffcost.profiles.params_for``).
FAMILY_PARENT = {
    "gb200": "b200",  # the B200 die in a Grace-Blackwell superchip
    "h200": "h100",  # the H100 die with HBM3e
    "h800": "h100",
    "gh200": "h100",
}
_PEAKS: dict[str, dict[str, float]] = {}
_PRESET_GPU: dict[str, str | None] = {}


def known_family(name: str) -> str | None:
    """GPU family key of a name that names a known family (``gpu_family`` without the
    fallback), else None."""
    m = _GPU_RE.search(name)
    return m.group(1).lower() if m else None


def gpu_family(name: str) -> str:
    """GPU family key of a GPU description.

    Unknown names give their text before any parenthesis, lower-cased, non-alphanumerics as
    ``-``.

    Examples:
        >>> gpu_family("H100 (sm_90; SKU not stated)"), gpu_family("AMD MI350 (gfx950)")
        ('h100', 'mi350')
        >>> gpu_family("GB200-B200"), gpu_family("Ascend 910B")
        ('gb200', 'ascend-910b')
    """
    known = known_family(name)
    if known:
        return known
    return re.sub(r"[^a-z0-9]+", "-", name.split("(")[0].lower()).strip("-")


def family_peak_flops(family: str, precision: str) -> float | None:
    """Dense datasheet FLOP/s of a GPU family at ``precision`` (its ``FAMILY_CLUSTER``
    preset), or None when the family or precision is unknown."""
    if family not in FAMILY_CLUSTER:
        return None
    if family not in _PEAKS:
        _PEAKS[family] = config.load_cluster(FAMILY_CLUSTER[family]).gpu.peak_tflops
    tflops = _PEAKS[family].get(precision)
    return tflops * 1e12 if tflops else None


def relative_rows(families: list[str]):
    """Per family of ``families``: the index of its ``FAMILY_PARENT`` there, else its own."""
    return np.array([families.index(FAMILY_PARENT[f]) if FAMILY_PARENT.get(f) in families
                     else i for i, f in enumerate(families)], dtype=int)  # fmt: skip


def cluster_family(cluster: str) -> str:
    """GPU family key of a cluster preset (an unknown preset raises ``ConfigError``)."""
    return gpu_family(config.load_cluster(cluster).gpu.name)


def preset_gpu(cluster: str) -> str | None:
    """GPU name of a cluster preset, or None when the preset cannot be loaded."""
    if cluster not in _PRESET_GPU:
        try:
            _PRESET_GPU[cluster] = config.load_cluster(cluster).gpu.name
        except (config.ConfigError, OSError):
            _PRESET_GPU[cluster] = None
    return _PRESET_GPU[cluster]


def preset_family(cluster: str) -> str | None:
    """GPU family key of a cluster preset, or None when the preset cannot be loaded."""
    name = preset_gpu(cluster)
    return None if name is None else gpu_family(name)
