"""The flax zoo through ``from_jax``: training-step FLOPs within 2% of XLA's cost analysis,
parameter counts of the reference architectures, DLRM's MLPerf tables, RetinaNet's frozen
backbone stages and outputs."""

from __future__ import annotations

import math

import jax
import pytest

from diffcost import zoo
from diffcost.opgraph import from_jax
from diffcost.opgraph.xla import xla_flops
from diffcost.zoo import detection
from diffcost.zoo.dlrm import MLPERF_DLRM_DCNV2

FLOP_TOLERANCE = 0.02  # the bar
PARAM_TOLERANCE = 0.005
# Small batches: the graphs (and XLA's compile) are the same, only dimensions shrink.
BATCH = {"resnet50": 1, "vgg16": 1, "vit_b16": 1, "dlrm_dcnv2": 64, "dlrm_dot": 64}
# Parameter counts of the reference models (torchvision's resnet50 and vgg16; ViT-B/16 of
# Dosovitskiy et al. with a 1000-class head, as timm's vit_base_patch16_224).
PARAMS = {"resnet50": 25_557_032, "vgg16": 138_357_544, "vit_b16": 86_567_656}


@pytest.fixture(scope="module", params=zoo.ZOO)
def traced(request):
    m = zoo.model(request.param, BATCH.get(request.param))
    return m, from_jax(m.fn, *m.args, argnums=m.argnums)


def test_step_flops_match_xla(traced):
    m, graph = traced
    assert graph.flops() == pytest.approx(
        xla_flops(m.fn, *m.args, argnums=m.argnums), rel=FLOP_TOLERANCE
    )


def test_backward_has_the_gemms_and_the_forward_saves_activations(traced):
    """Every forward GEMM gets a weight gradient, and all but the first layer a data gradient:
    backward GEMM FLOPs between 1x and 2x the forward's."""
    _, graph = traced
    kinds = ("matmul", "convolution", "attention")
    ratio = graph.flops("backward", kinds) / graph.flops("forward", kinds)
    assert 1.0 < ratio <= 2.0 + 1e-9
    assert graph.saved_bytes > 0


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts_match_the_references(name):
    m = zoo.model(name, 1)
    count = sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(m.args[0]))
    assert count == pytest.approx(PARAMS[name], rel=PARAM_TOLERANCE)


def test_dlrm_has_the_mlperf_tables_and_lookups():
    m = zoo.model("dlrm_dcnv2", 8)
    params = m.args[0]
    tables = [params[f"EmbeddingBag_{i}"]["table"].shape for i in range(26)]
    dim = MLPERF_DLRM_DCNV2["embedding_dim"]
    assert tables == [(rows, dim) for rows in MLPERF_DLRM_DCNV2["rows"]]
    graph = from_jax(m.fn, *m.args, argnums=m.argnums)
    gathers = [op for op in graph.select("forward", ["gather"]) if op.primitive == "gather"]
    assert len(gathers) == 26
    # a lookup reads the rows it returns, not the table
    assert max(op.bytes_read for op in gathers) < 8 * 100 * dim * 4 * 2


def test_unknown_zoo_model_is_named():
    with pytest.raises(ValueError, match="unknown model 'resnet51'.*resnet50"):
        zoo.model("resnet51")
    with pytest.raises(ValueError, match="batch 0"):
        zoo.model("mlp", 0)


# torchvision's resnext50_32x4d (25,028,904 parameters, batch-norm weights and biases included)
# without its 2048 x 1000 classifier: the detector's backbone
RESNEXT50_PARAMS = 25_028_904 - (2048 * 1000 + 1000)


def _conv_params(k, c_in, c_out, bias=True):
    return k * k * c_in * c_out + (c_out if bias else 0)


def test_retinanet_has_the_reference_shapes_and_parameters():
    m = zoo.model("retinanet", 2)
    logits, boxes = jax.eval_shape(m.fn, *m.args)
    positions = sum(s * s for s in (100, 50, 25, 13, 7))  # P3-P7 of an 800x800 image
    anchors = detection.ANCHORS * positions
    assert logits.shape == (2, anchors, detection.OPENIMAGES_MLPERF_CLASSES)
    assert boxes.shape == (2, anchors, 4)
    c = detection.FPN_CHANNELS
    fpn = sum(_conv_params(1, w, c) + _conv_params(3, c, c) for w in (512, 1024, 2048))
    fpn += 2 * _conv_params(3, c, c)  # P6, P7
    heads = 2 * detection.HEAD_CONVS * _conv_params(3, c, c)
    heads += _conv_params(3, c, detection.ANCHORS * detection.OPENIMAGES_MLPERF_CLASSES)
    heads += _conv_params(3, c, detection.ANCHORS * 4)
    trained, (frozen, constants) = m.args[0], m.args[1]
    count = [sum(math.prod(x.shape) for x in jax.tree.leaves(t)) for t in (trained, frozen)]
    n_constants = sum(math.prod(x.shape) for x in jax.tree.leaves(constants))
    assert sum(count) + n_constants == RESNEXT50_PARAMS + fpn + heads
    # trainable_backbone_layers=3: the stem and the first stage are not trained
    assert sorted(frozen) == ["layer1_0", "layer1_1", "layer1_2", "stem"]
    assert set(constants) == {"frozen_bn"}


def test_retinanet_frozen_stages_have_no_backward_and_its_forward_matches_xla():
    m = zoo.model("retinanet", 1)
    graph = from_jax(m.fn, *m.args, argnums=m.argnums)
    assert graph.flops("forward") == pytest.approx(
        xla_flops(m.fn, *m.args, backward=False), rel=FLOP_TOLERANCE
    )
    frozen = [
        op.scope
        for op in graph.operators
        if op.phase == "backward" and ("/stem" in op.scope or "/layer1_" in op.scope)
    ]
    assert frozen == []

    # every trained backbone convolution has a weight gradient, and all but the two that read
    # the frozen first stage's output (layer2's first 1x1 and its projection) a data gradient
    def convs(phase):
        return [o for o in graph.select(phase, ["convolution"]) if "backbone" in o.scope]

    trained = [o for o in convs("forward") if "/layer1_" not in o.scope and "/stem" not in o.scope]
    assert len(convs("backward")) == 2 * len(trained) - 2
