"""Graph models by name: a zoo entry, or a user's JAX function named ``module:function``.

``load_graph_model(name, batch)`` traces the model with ``from_jax`` and returns a
``GraphModel``: the graph, a readable name for each of its inputs (the argument's position and
the pytree path of the leaf: ``0/params/Dense_0/kernel``) and which inputs carry the batch: the
leaves whose leading dimension is the batch size, of the arguments that are neither
differentiated nor mappings (parameter and batch-norm statistics dicts are mappings; data
arguments are arrays or tuples of them).

A user's model is ``module:function`` (a dotted module on ``sys.path``, or a path to a ``.py``
file) naming a factory. The factory is called with ``batch=`` when it takes that argument and a
batch was given (else with no argument) and returns ``(fn, example_args)``, ``(fn,
example_args, argnums)``, or an object with ``fn``, ``args``, ``argnums`` (a ``zoo.ZooModel``).
The example arguments are pytrees of arrays or ``jax.ShapeDtypeStruct``; ``argnums`` default:
argument 0 (the parameters).

Examples:
    >>> m = load_graph_model("mlp", batch=32)
    >>> m.batch, m.input_names[0]
    (32, '0/params/Dense_0/bias')
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping

import jax

from diffcost import zoo
from diffcost.opgraph.ir import Graph
from diffcost.opgraph.trace import from_jax


@dataclasses.dataclass(frozen=True)
class GraphModel:
    """A traced graph model: its name, graph, batch size, one name per graph input, and the
    graph inputs (tensor ids) that carry the batch along their leading axis."""

    name: str
    graph: Graph
    batch: int | None
    input_names: tuple[str, ...]
    batch_inputs: frozenset[int]


def _leaf_names(args) -> list[str]:
    """``"i/path"`` of every leaf of the arguments, in ``from_jax``'s flattening order."""
    names = []
    for i, a in enumerate(args):
        for path, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            names.append(f"{i}/{key}" if key else str(i))
    return names


def _factory(target: str):
    """The function ``module:function`` names (``module`` dotted, or a ``.py`` path)."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"graph model {target!r}: not a zoo name and not 'module:function'; "
            f"zoo names: {', '.join(zoo.ZOO)}"
        )
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise FileNotFoundError(f"graph model {target!r}: no file {module_name!r}")
        spec = importlib.util.spec_from_file_location(
            os.path.basename(module_name)[:-3], module_name
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"graph model {target!r}: cannot import module {module_name!r} ({e}); give "
                "a dotted module on the Python path or a path to a .py file"
            ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"graph model {target!r}: module {module_name!r} has no function {attr!r}")
    return fn


def _user_model(target: str, batch: int | None):
    """``(fn, args, argnums)`` of a user factory."""
    factory = _factory(target)
    takes_batch = "batch" in inspect.signature(factory).parameters
    made = factory(batch=batch) if takes_batch and batch is not None else factory()
    if hasattr(made, "fn") and hasattr(made, "args"):
        return made.fn, tuple(made.args), tuple(getattr(made, "argnums", (0,)))
    if isinstance(made, tuple) and len(made) in (2, 3) and callable(made[0]):
        argnums = made[2] if len(made) == 3 else (0,)
        argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        return made[0], tuple(made[1]), argnums
    raise ValueError(
        f"graph model {target!r}: the factory returned {type(made).__name__}; it must return "
        "(fn, example_args), (fn, example_args, argnums) or an object with fn, args, argnums"
    )


def load_graph_model(name: str, batch: int | None = None) -> GraphModel:
    """Trace the zoo model ``name`` or the user factory ``module:function`` at ``batch``.

    Raises:
        ValueError: an unknown zoo name, a bad ``module:function``, a batch below 1.
        FileNotFoundError: a ``.py`` path that does not exist.
    """
    if batch is not None and int(batch) < 1:
        raise ValueError(f"graph model {name!r}: batch {batch}; must be >= 1")
    if ":" not in name:
        if name not in zoo.ZOO:
            raise ValueError(
                f"graph model {name!r}: unknown zoo name; valid: {', '.join(zoo.ZOO)}, "
                "or 'module:function' for your own JAX function"
            )
        m = zoo.model(name, batch)
        fn, args, argnums, batch = m.fn, m.args, m.argnums, m.batch
    else:
        fn, args, argnums = _user_model(name, batch)
    graph = from_jax(fn, *args, argnums=argnums)
    names = _leaf_names(args)
    leaves = [len(jax.tree_util.tree_leaves(a)) for a in args]
    data = {i for i, a in enumerate(args) if i not in argnums and not isinstance(a, Mapping)}
    owner = [i for i, n in enumerate(leaves) for _ in range(n)]
    if batch is None:  # a user's model: the leading dimension of its last argument
        last = jax.tree_util.tree_leaves(args[-1])
        batch = int(last[0].shape[0]) if last and last[0].shape else None
    batch_inputs = frozenset(
        t
        for t, arg in zip(graph.inputs, owner)
        if arg in data and graph.tensors[t].shape[:1] == (batch,)
    )
    return GraphModel(name, graph, batch, tuple(names), batch_inputs)
