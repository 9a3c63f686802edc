"""Software stacks: what the training framework decides, as offsets on calibrated constants.

The same GPUs run a model at different speeds under Megatron-Core with Transformer Engine,
Megatron-DeepSpeed or PyTorch FSDP: the stack picks the kernels (GEMM and attention
efficiency, memory-bound passes), how much host work each layer and microbatch costs and how
much of it hides behind the GPU, what overlaps with what, and the per-iteration overhead. Each
``STACK_EFFECTS`` entry shifts one raw ``Params`` leaf (log for positive constants, logit for
fractions) by a per-stack offset; a stack the data have never seen gets offset 0 — the
population of stacks the fit saw — and a prediction for it is less certain.

``STACKS`` maps a stack to the frameworks (the ``framework`` column of run CSVs, matched as in
``diffcost.runs``) that share its kernels and runtime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp

from diffcost.params import BY_LEAF, Params


@dataclasses.dataclass(frozen=True)
class Stack:
    name: str
    frameworks: tuple[str, ...]  # case-insensitive substrings of a run's framework cell
    description: str


STACKS = (
    Stack("megatron-core", ("Megatron-Core", "Megatron-Bridge", "NeMo"),
          "Megatron-Core with Transformer Engine (NeMo, Megatron-Bridge, Megatron-LM)"),
    Stack("megatron-deepspeed", ("Megatron-DeepSpeed",), "Megatron-DeepSpeed"),
    Stack("megatron-lm-v1", ("Megatron-LM v1",), "Megatron-LM 1.x (2019-2020)"),
    Stack("pytorch-fsdp", ("llm-foundry", "torchtitan", "FSDP"),
          "PyTorch FSDP / FSDP2 (llm-foundry, torchtitan)"),
    Stack("jax-xla", ("Alpa", "JAX", "XLA"), "JAX / XLA (Alpa, MaxText, Pax)"),
)  # fmt: skip
STACK_NAMES = tuple(s.name for s in STACKS)


@dataclasses.dataclass(frozen=True)
class StackEffect:
    """A per-stack offset on one raw ``Params`` leaf, drawn around 0 with width ``prior_sd``."""

    leaf: str
    prior_sd: float

    @property
    def name(self) -> str:
        return BY_LEAF[self.leaf].name


# Widths: how far one stack's kernels and runtime plausibly sit from the population's, in raw
# units. Kernel efficiencies of mature stacks differ by tens of percent (0.5 in logit moves
# 0.75 to 0.67 or 0.83); host costs and overheads by up to a factor of two (0.7 in log).
STACK_EFFECTS = (
    StackEffect("gemm_eff_logit", 0.5),
    StackEffect("attn_eff_logit", 0.5),
    StackEffect("mem_eff_logit", 0.5),
    StackEffect("host_op_log_s", 0.7),
    StackEffect("host_overlap_logit", 0.7),
    StackEffect("interference_log", 0.7),
    StackEffect("microbatch_overhead_log_s", 0.7),
    StackEffect("iteration_overhead_log_s", 0.7),
)
EFFECT_BY_NAME = {e.name: e for e in STACK_EFFECTS}


def stack_of(framework: str | None) -> str | None:
    """The stack of a run's framework cell (None: blank or not one ``STACKS`` names)."""
    text = (framework or "").lower()
    return next((s.name for s in STACKS for f in s.frameworks if f.lower() in text), None)


def canonical(text: str | None) -> str | None:
    """A stack as a user or a run names it: a ``STACK_NAMES`` name as it is, a framework
    (``"NeMo"``, ``"torchtitan"``) as its stack, anything else stripped (a stack no profile
    knows); None when blank."""
    text = (text or "").strip()
    if not text:
        return None
    return text if text in STACK_NAMES else stack_of(text) or text


def apply_stack(params: Params, offsets: Mapping[str, object]) -> Params:
    """``params`` with each ``{leaf: raw offset}`` added to its leaf (a scalar offset shifts
    every precision of a per-precision leaf)."""
    return params.replace(
        **{leaf: getattr(params, leaf) + jnp.asarray(v) for leaf, v in offsets.items()}
    )
