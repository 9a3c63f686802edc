"""A zoo of flax models as shape-only training-step functions for ``diffcost.from_jax``.

``model(name)`` returns a ``ZooModel``: a function ``fn(params, *inputs)`` (or ``fn(params,
state, inputs)`` for models with batch-norm statistics) and abstract example arguments
(``jax.ShapeDtypeStruct``; parameters come from ``jax.eval_shape`` of the flax ``init``, so
nothing is allocated, even for DLRM's 40M-row tables). ``argnums`` names the trained arguments
(the parameters: the input's gradient, and so the first layer's dgrad, is not computed). Frozen
parts (RetinaNet's stem, first stage and batch-norm constants) are a separate untrained
argument: no weight gradient, and no backward at all below the first trained layer.

Examples:
    >>> import diffcost
    >>> from diffcost import zoo
    >>> m = zoo.model("mlp")
    >>> g = diffcost.from_jax(m.fn, *m.args, argnums=m.argnums)
    >>> round(g.flops("backward", kinds=["matmul"]) / g.flops("forward", kinds=["matmul"]), 2)
    1.57
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from diffcost.zoo.dense import MLP, EncoderBlock
from diffcost.zoo.detection import IMAGE_SIZE, RetinaNet, frozen_subtrees
from diffcost.zoo.dlrm import DLRM, MLPERF_DLRM_DCNV2
from diffcost.zoo.vision import VGG16, ResNet50, SmallCNN, UNet3D, ViT


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    fn: Callable
    args: tuple
    argnums: tuple[int, ...]
    description: str
    batch: int


def _spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _flax(name, module, inputs, description, batch) -> ZooModel:
    """A ``ZooModel`` of a flax module applied to abstract ``inputs``; batch-norm statistics,
    if any, are a separate untrained argument."""
    variables = jax.eval_shape(module.init, jax.random.key(0), *inputs)
    params = variables["params"]
    if isinstance(module, RetinaNet):
        return _partly_frozen(name, module, variables, inputs, description, batch)
    if "batch_stats" in variables:

        def fn_bn(params, stats, *xs):
            out, _ = module.apply(
                {"params": params, "batch_stats": stats}, *xs, mutable=["batch_stats"]
            )
            return out

        stats = variables["batch_stats"]
        return ZooModel(name, fn_bn, (params, stats, *inputs), (0,), description, batch)

    def fn(params, *xs):
        return module.apply({"params": params}, *xs)

    return ZooModel(name, fn, (params, *inputs), (0,), description, batch)


def _partly_frozen(name, module, variables, inputs, description, batch) -> ZooModel:
    """``fn(trained, (frozen, constants), *inputs)``: the parameter subtrees the reference
    freezes (``detection.frozen_subtrees``) and every non-parameter collection (frozen batch
    norm) are the second, untrained argument."""
    trained = dict(variables["params"])
    frozen = {k: trained.pop(k) for k in frozen_subtrees(trained)}
    constants = {c: v for c, v in variables.items() if c != "params"}

    def fn(trained, fixed, *xs):
        frozen, constants = fixed
        return module.apply({"params": {**trained, **frozen}, **constants}, *xs)

    return ZooModel(name, fn, (trained, (frozen, constants), *inputs), (0,), description, batch)


def _image(batch, size=224, channels=3):
    return (_spec((batch, size, size, channels)),)


def _dlrm(batch, interaction, rows_cap=None):
    d = MLPERF_DLRM_DCNV2
    rows = tuple(r if rows_cap is None else min(r, rows_cap) for r in d["rows"])
    module = DLRM(
        d["bottom"], d["top"], rows, d["embedding_dim"], interaction, d["dcn_layers"], d["dcn_rank"]
    )
    sparse = tuple(_spec((batch, p), jnp.int32) for p in d["pooling"])
    return module, (_spec((batch, d["dense_features"])), sparse)


# name: (builder(batch) -> (module, inputs), default batch, description)
_MODELS = {
    "resnet50": (lambda b: (ResNet50(), _image(b)), 8, "ResNet-50 v1.5, 224x224, 1000 classes"),
    "vgg16": (lambda b: (VGG16(), _image(b)), 8, "VGG-16 (configuration D), 224x224"),
    "vit_b16": (lambda b: (ViT(), _image(b)), 8, "ViT-B/16, 224x224 (197 tokens)"),
    "unet3d": (
        lambda b: (UNet3D(), (_spec((b, 128, 128, 128, 1)),)),
        1,
        "MLPerf 3D U-Net (KiTS19), 128^3 patches, 32-320 channels, 3 classes",
    ),
    "retinanet": (
        lambda b: (RetinaNet(), _image(b, IMAGE_SIZE)),
        1,
        "MLPerf SSD: RetinaNet, ResNeXt-50 32x4d, FPN P3-P7, 800x800, 264 classes",
    ),
    "dlrm_dcnv2": (
        lambda b: _dlrm(b, "dcn"),
        2048,
        "MLPerf DLRM-DCNv2 dims: 26 tables (dim 128, multi-hot), DCNv2 3x rank 512",
    ),
    "dlrm_dot": (
        lambda b: _dlrm(b, "dot"),
        2048,
        "DLRM with dot interaction, MLPerf DLRM-DCNv2 tables and MLPs",
    ),
    "small_cnn": (lambda b: (SmallCNN(), _image(b, 32)), 16, "two 3x3 convolutions, 32x32"),
    "mlp": (lambda b: (MLP(), (_spec((b, 784)),)), 64, "MLP 784-1024-1024-10"),
    "transformer_block": (
        lambda b: (EncoderBlock(heads=8, mlp=2048), (_spec((b, 128, 512)),)),
        4,
        "pre-norm encoder block, width 512, 8 heads, MLP 2048, 128 tokens",
    ),
}
ZOO = tuple(_MODELS)


def model(name: str, batch: int | None = None) -> ZooModel:
    """The zoo model ``name`` (one of ``ZOO``) at ``batch`` samples (default per model)."""
    if name not in _MODELS:
        raise ValueError(f"zoo.model: unknown model {name!r}; valid: {', '.join(ZOO)}")
    build, default, description = _MODELS[name]
    batch = default if batch is None else int(batch)
    if batch < 1:
        raise ValueError(f"zoo.model({name!r}): batch {batch}; must be >= 1")
    module, inputs = build(batch)
    return _flax(name, module, inputs, description, batch)


__all__ = ["ZOO", "ZooModel", "model"]
