"""Speed of the peer tools, as measured on this project's machine class.

Calculon (a pure-Python analytical model of LLM training) was timed on one core of this
machine class (2 cores, 24 GiB, no GPU) on 2026-11-24: 1.86 ms per configuration. Benchmarks
that compare with it import this figure instead of repeating it.
"""

CALCULON_MS_PER_CONFIG = 1.86
CALCULON_MEASURED = "2026-11-24, one core of this machine class"


def vs_calculon(configs_per_s: float) -> float:
    """How many times faster than Calculon a rate of ``configs_per_s`` is."""
    return configs_per_s * CALCULON_MS_PER_CONFIG / 1000.0
