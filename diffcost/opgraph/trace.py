"""``from_jax``: the operator graph of a JAX function, traced with shapes only.

The function is traced with ``jax.make_jaxpr`` on abstract arguments (``jax.ShapeDtypeStruct``;
nothing runs and no parameter is allocated). The forward pass is the jaxpr of ``jax.vjp(fn,
...)``: the function's operations plus the residuals it keeps for the backward pass, which
become the graph's ``saved`` tensors. The backward pass is the jaxpr of the returned VJP
function applied to an output cotangent, i.e. exactly the backward ``jax.vjp`` implies
(transposed linearization), reading the saved tensors.

The walk recurses into calls (``pjit``, ``closed_call``, ``custom_jvp_call``,
``custom_vjp_call``, ``checkpoint``/``remat``, ``shard_map``); a ``scan`` body counts
``length`` times; a ``while`` body whose trip count cannot be known from the jaxpr counts once
and the graph's ``notes`` say so; a ``cond`` contributes its costliest branch (noted).
Every other primitive gets its cost from ``diffcost.opgraph.counting`` or a clear
``UnsupportedPrimitiveError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from diffcost.opgraph import counting
from diffcost.opgraph.ir import Graph, Operator, Tensor

# Call-like primitives and the parameter holding their body.
_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "shard_map": "jaxpr",
}
_ATTENTION_SCOPE = "attention"
# JAX names the scope of the operations its transpose (reverse-mode) rules emit "transpose(...)".
_TRANSPOSED = "transpose("


def _open(jaxpr):
    """The open jaxpr of a closed or open one (a closed jaxpr's constants become argument-like
    tensors of the graph: no operator produces them)."""
    return jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr


class _Builder:
    """Accumulates tensors and operators while walking jaxprs."""

    def __init__(self):
        self.tensors: list[Tensor] = []
        self.operators: list[Operator] = []
        self.notes: list[str] = []

    def tensor(self, aval, producer: int = -1) -> int:
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = str(getattr(aval, "dtype", "float32"))
        if dtype.startswith("key<") or dtype == "float0":
            dtype = "uint32" if dtype.startswith("key<") else "bool"
        self.tensors.append(Tensor(len(self.tensors), shape, dtype, producer))
        return len(self.tensors) - 1

    def walk(self, jaxpr, in_ids, phase, count, scope) -> list[int | None]:
        """Add the operators of ``jaxpr`` (closed or open) whose inputs are tensors ``in_ids``
        (None for a literal); returns its outputs' tensor ids."""
        inner = _open(jaxpr)
        env: dict = {var: self.tensor(var.aval) for var in inner.constvars}
        for var, tid in zip(inner.invars, in_ids):
            env[var] = self.tensor(var.aval) if tid is None else tid
        for eqn in inner.eqns:
            self.equation(eqn, env, phase, count, scope)
        return [self.read(env, v) for v in inner.outvars]

    def read(self, env, var) -> int | None:
        if isinstance(var, jcore.Literal):
            return None
        if var not in env:
            env[var] = self.tensor(var.aval)
        return env[var]

    def bind_outputs(self, eqn, env, inner_out: Sequence[int | None], reshape: bool):
        """Outputs of a higher-order equation: the body's own tensors for a call, new tensors
        of the outer shape (produced by the body's producer) for a loop."""
        for var, tid in zip(eqn.outvars, inner_out):
            if tid is not None and not reshape:
                env[var] = tid
            else:
                producer = -1 if tid is None else self.tensors[tid].producer
                env[var] = self.tensor(var.aval, producer)

    def equation(self, eqn, env, phase, count, scope):
        name = eqn.primitive.name
        in_ids = [self.read(env, v) for v in eqn.invars]
        here = str(eqn.source_info.name_stack) or scope
        if name in _CALLS:
            body = eqn.params[_CALLS[name]]
            if name == "pjit" and eqn.params.get("name"):
                here = f"{here}/{eqn.params['name']}" if here else eqn.params["name"]
            out = self.walk(body, in_ids, phase, count, here)
            self.bind_outputs(eqn, env, out, reshape=False)
        elif name == "scan":
            out = self.walk(eqn.params["jaxpr"], in_ids, phase, count * eqn.params["length"], here)
            self.bind_outputs(eqn, env, out, reshape=True)
        elif name == "while":
            self.while_loop(eqn, env, in_ids, phase, count, here)
        elif name == "cond":
            self.conditional(eqn, env, in_ids, phase, count, here)
        else:
            self.primitive(eqn, env, in_ids, phase, count, here)

    def while_loop(self, eqn, env, in_ids, phase, count, scope):
        p = eqn.params
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        body_in = in_ids[n_cond : n_cond + n_body] + in_ids[n_cond + n_body :]
        self.notes.append(
            f"while loop in {scope or 'the top level'} ({phase}): trip count unknown from "
            f"the jaxpr, its body is counted once"
        )
        out = self.walk(p["body_jaxpr"], body_in, phase, count, scope)
        self.bind_outputs(eqn, env, out, reshape=True)

    def conditional(self, eqn, env, in_ids, phase, count, scope):
        branches = eqn.params["branches"]
        flops = []
        for branch in branches:
            trial = _Builder()
            trial.walk(branch, [None] * len(in_ids[1:]), phase, count, scope)
            flops.append(sum(op.flops * op.count for op in trial.operators))
        pick = int(np.argmax(flops))
        self.notes.append(
            f"cond in {scope or 'the top level'} ({phase}): {len(branches)} branches, the "
            f"costliest (branch {pick}) is counted"
        )
        out = self.walk(branches[pick], in_ids[1:], phase, count, scope)
        self.bind_outputs(eqn, env, out, reshape=True)

    def primitive(self, eqn, env, in_ids, phase, count, scope):
        name = eqn.primitive.name
        in_avals = [v.aval for v in eqn.invars]
        out_avals = [v.aval for v in eqn.outvars]
        c = counting.cost(name, in_avals, out_avals, eqn.params)
        if _TRANSPOSED in scope:  # a traced training step's own backward (jax.grad)
            phase = "backward"
        kind = c.kind
        if kind == "matmul" and c.gemm[0] > 1 and _ATTENTION_SCOPE in scope.lower():
            kind = "attention"
        index = len(self.operators)
        outs = [self.tensor(v.aval, index) for v in eqn.outvars]
        for var, tid in zip(eqn.outvars, outs):
            if not isinstance(var, jcore.DropVar):
                env[var] = tid
        dtype = str(in_avals[0].dtype) if in_avals and hasattr(in_avals[0], "dtype") else ""
        self.operators.append(
            Operator(
                name=f"{phase[0]}{index}:{name}",
                primitive=name,
                kind=kind,
                phase=phase,
                inputs=tuple(t for t in in_ids if t is not None),
                outputs=tuple(outs),
                dtype=dtype,
                flops=c.flops,
                transcendentals=c.transcendentals,
                bytes_read=c.bytes_read,
                bytes_written=c.bytes_written,
                count=float(count),
                gemm=c.gemm,
                scope=scope,
                attributes=c.attributes,
            )
        )


def abstract_args(args, where: str):
    """``args`` as ShapeDtypeStruct leaves (arrays are turned into their shapes)."""

    def one(path, leaf):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"from_jax: example argument {where}{jax.tree_util.keystr(path)} is "
                f"{type(leaf).__name__} {leaf!r}; expected an array or jax.ShapeDtypeStruct"
            )
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, args)


def _is_float(tree) -> bool:
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves)


def differentiated(args, argnums) -> tuple[int, ...]:
    """The argument positions the backward pass differentiates: ``argnums``, or every
    argument whose leaves are all floating point."""
    if argnums is None:
        return tuple(i for i, a in enumerate(args) if _is_float(a))
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for i in argnums:
        if not 0 <= i < len(args):
            raise ValueError(f"from_jax: argnums has {i}; the function takes {len(args)} args")
        if not _is_float(args[i]):
            raise ValueError(f"from_jax: argument {i} (in argnums) is not floating point")
    return argnums


def split_call(fn, args, wrt: tuple[int, ...]):
    """``fn`` as a function of (differentiated args, other args) in that order."""
    others = tuple(i for i in range(len(args)) if i not in wrt)

    def call(diff, rest):
        full = [None] * len(args)
        for i, a in zip(wrt, diff):
            full[i] = a
        for i, a in zip(others, rest):
            full[i] = a
        return fn(*full)

    return call, others


def from_jax(fn, *example_args, argnums=None, backward: bool = True) -> Graph:
    """The operator graph of ``fn(*example_args)``: forward, and the backward ``jax.vjp``
    implies.

    Args:
        fn: a JAX function (e.g. ``lambda params, x: model.apply(params, x)``).
        *example_args: pytrees of ``jax.ShapeDtypeStruct`` (or arrays: only their shapes and
            dtypes are used; nothing runs).
        argnums: argument positions to differentiate; default every floating-point argument.
        backward: False to trace ``fn`` as it is, with no backward added (no saved tensors):
            for a forward pass alone, or for a training step that takes its own gradients
            (``jax.grad`` inside ``fn``), whose reverse-mode operations are then the graph's
            backward phase (JAX names their scope ``transpose(...)``); everything else,
            optimizer update included, is the forward phase.

    Returns:
        A ``Graph``. Its ``inputs`` are the flattened arguments in order; ``outputs`` the
        flattened results; ``gradients`` the backward's results (flattened gradients of the
        ``argnums`` arguments).

    Raises:
        UnsupportedPrimitiveError: the function uses a primitive without a cost rule.
        TypeError / ValueError: an argument is not an array or ShapeDtypeStruct, or ``argnums``
            names a non-floating argument.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
        >>> w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
        >>> g = from_jax(lambda w, x: jnp.tanh(x @ w), w, x, argnums=0)
        >>> g.flops("forward", kinds=["matmul"]), g.flops("backward", kinds=["matmul"])
        (1024.0, 1024.0)
    """
    args = tuple(abstract_args(a, f"{i} ") for i, a in enumerate(example_args))
    b = _Builder()
    arg_ids = [[b.tensor(leaf) for leaf in jax.tree_util.tree_leaves(a)] for a in args]
    inputs = tuple(t for ids in arg_ids for t in ids)
    if not backward:
        out = b.walk(jax.make_jaxpr(fn)(*args), list(inputs), "forward", 1, "")
        return _graph(b, inputs, out, (), ())
    wrt = differentiated(args, argnums)
    call, others = split_call(fn, args, wrt)
    diff, rest = tuple(args[i] for i in wrt), tuple(args[i] for i in others)

    def forward(diff, rest):
        return jax.vjp(lambda *d: call(d, rest), *diff)

    fwd_jaxpr, (out_shape, vjp_shape) = jax.make_jaxpr(forward, return_shape=True)(diff, rest)
    fwd_in = [t for i in wrt for t in arg_ids[i]] + [t for i in others for t in arg_ids[i]]
    fwd_out = b.walk(fwd_jaxpr, fwd_in, "forward", 1, "")
    _check_outputs(out_shape)
    n_out = len(jax.tree_util.tree_leaves(out_shape))
    residuals, vjp_tree = jax.tree_util.tree_flatten(vjp_shape)

    def backward_fn(res, cotangent):
        return jax.tree_util.tree_unflatten(vjp_tree, res)(cotangent)

    bwd_jaxpr = jax.make_jaxpr(backward_fn)(residuals, out_shape)
    cotangents = [b.tensor(leaf) for leaf in jax.tree_util.tree_leaves(out_shape)]
    grads = b.walk(bwd_jaxpr, fwd_out[n_out:] + cotangents, "backward", 1, "")
    # Residuals the backward never reads (JAX's VJP may carry some) are not kept by a
    # compiled step.
    read = {t for op in b.operators if op.phase == "backward" for t in op.inputs} | set(grads)
    saved = tuple(dict.fromkeys(t for t in fwd_out[n_out:] if t is not None and t in read))
    return _graph(b, inputs, fwd_out[:n_out], grads, saved)


def _check_outputs(out_shape):
    """A backward pass needs floating-point outputs to take a cotangent."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(out_shape):
        if not np.issubdtype(leaf.dtype, np.inexact):
            raise ValueError(
                f"from_jax: output {jax.tree_util.keystr(path) or '(the result)'} has dtype "
                f"{leaf.dtype}; the backward pass needs floating-point outputs only (return "
                f"the integer outputs from another function, or pass backward=False)"
            )


def _live_operators(b: _Builder, roots) -> list[int]:
    """Indices of the operators the ``roots`` tensors depend on (XLA removes the others: the
    linearization computes some values only for residuals the backward never reads)."""
    needed = {b.tensors[t].producer for t in roots}
    keep = []
    for i in range(len(b.operators) - 1, -1, -1):  # operators are in topological order
        if i in needed:
            keep.append(i)
            needed.update(b.tensors[t].producer for t in b.operators[i].inputs)
    return keep[::-1]


def _graph(b: _Builder, inputs, outputs, gradients, saved) -> Graph:
    """The graph of the live operators, tensors and operators renumbered in order."""
    outputs = [t for t in outputs if t is not None]
    gradients = [t for t in gradients if t is not None]
    keep = _live_operators(b, [*outputs, *gradients, *saved])
    op_index = {old: new for new, old in enumerate(keep)}
    used = set(inputs) | set(outputs) | set(gradients) | set(saved)
    for i in keep:
        used.update(b.operators[i].inputs)
        used.update(b.operators[i].outputs)
    tensor_index = {old: new for new, old in enumerate(sorted(used))}
    tensors = tuple(
        dataclasses.replace(
            b.tensors[old], id=new, producer=op_index.get(b.tensors[old].producer, -1)
        )
        for old, new in tensor_index.items()
    )
    renumber = lambda ids: tuple(tensor_index[t] for t in ids)  # noqa: E731
    operators = []
    for new, old in enumerate(keep):
        op = b.operators[old]
        operators.append(
            dataclasses.replace(
                op,
                name=f"{op.phase[0]}{new}:{op.primitive}",
                inputs=renumber(op.inputs),
                outputs=renumber(op.outputs),
            )
        )
    return Graph(
        tensors=tensors,
        operators=tuple(operators),
        inputs=renumber(inputs),
        outputs=renumber(outputs),
        gradients=renumber(gradients),
        saved=renumber(saved),
        notes=tuple(dict.fromkeys(b.notes)),
    )
