"""Operator graphs: a general workload IR, imported from JAX functions and priced per operator."""

from diffcost.opgraph.counting import UnsupportedPrimitiveError
from diffcost.opgraph.ir import OP_KINDS, Graph, Operator, OperatorSharding, Sbp, Tensor
from diffcost.opgraph.pricing import GraphArrays, graph_arrays, graph_time_s, op_times_s
from diffcost.opgraph.trace import from_jax

__all__ = [
    "OP_KINDS",
    "Graph",
    "GraphArrays",
    "Operator",
    "OperatorSharding",
    "Sbp",
    "Tensor",
    "UnsupportedPrimitiveError",
    "from_jax",
    "graph_arrays",
    "graph_time_s",
    "op_times_s",
]
