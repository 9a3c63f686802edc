"""diffcost: differentiable prediction of distributed training time and memory."""

from diffcost.api import experiment_arrays, load, predict, simulate_jit
from diffcost.interval import Prediction, predict_interval
from diffcost.opgraph import Graph, from_jax, graph_time_s
from diffcost.params import Params, default_params
from diffcost.search import optimize
from diffcost.simulate import Breakdown, simulate

__all__ = [
    "Breakdown",
    "Graph",
    "Params",
    "Prediction",
    "default_params",
    "experiment_arrays",
    "from_jax",
    "graph_time_s",
    "load",
    "optimize",
    "predict",
    "predict_interval",
    "simulate",
    "simulate_jit",
]
__version__ = "0.1.0"
