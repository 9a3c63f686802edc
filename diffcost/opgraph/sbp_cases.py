"""Random small SBP problems for tests and benchmarks: MLP chains traced with ``from_jax``.

Each case is a chain of matrix products with random widths, batch and activation, and a mesh
of 2-16 GPUs of one cluster; its use graph is a tree, so ``sbp_search.exact_tree`` gives the
exact optimum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from diffcost.opgraph.ir import Graph
from diffcost.opgraph.trace import from_jax

_ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu, "none": lambda x: x}


@dataclasses.dataclass(frozen=True)
class ChainCase:
    """An MLP chain ``x -> act(x @ w_1) -> ... -> x @ w_L`` on ``mesh_size`` GPUs."""

    batch: int
    widths: tuple[int, ...]
    activation: str
    mesh_size: int
    dtype: str = "float32"

    def graph(self) -> Graph:
        act = _ACTIVATIONS[self.activation]

        def fn(weights, x):
            for i, w in enumerate(weights):
                x = x @ w
                if i < len(weights) - 1:
                    x = act(x)
            return x

        spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(self.dtype))  # noqa: E731
        ws = tuple(spec(a, b) for a, b in zip(self.widths[:-1], self.widths[1:]))
        return from_jax(fn, ws, spec(self.batch, self.widths[0]), argnums=(0,))


def random_chains(n: int, seed: int = 0) -> list[ChainCase]:
    """``n`` random chains: 2-4 products, widths 256-16384, batch 8-16384, 2-16 GPUs."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n):
        layers = int(rng.integers(2, 5))
        widths = tuple(int(2 ** rng.integers(8, 15)) for _ in range(layers + 1))
        cases.append(
            ChainCase(
                batch=int(2 ** rng.integers(3, 15)),
                widths=widths,
                activation=str(rng.choice(list(_ACTIVATIONS))),
                mesh_size=int(2 ** rng.integers(1, 5)),
            )
        )
    return cases
