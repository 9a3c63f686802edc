"""Cross checks of a plan against its model and cluster (diffcost.config.check_plan and
validate_experiment): divisibility, GPU counts, precisions, and the messages they give."""

from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest
from helpers import write

from diffcost.config import (
    ConfigError,
    check_plan,
    load_cluster,
    load_experiment,
    load_model,
    validate_experiment,
)
from diffcost.specs import Experiment, ModelSpec, MoeSpec, PlanSpec


def experiment_text(plan: str, model: str = "llama3-70b", cluster: str = "dgx-h100") -> str:
    body = textwrap.indent(textwrap.dedent(plan).strip(), "  ")
    return f"model: {model}\ncluster: {cluster}\nplan:\n{body}\n"


def tiny_model(**changes) -> ModelSpec:
    model = ModelSpec("tiny", 8, 512, 2048, 8, 8, 1024, 1000)
    return dataclasses.replace(model, **changes)


def load_with(tmp_path, plan: str, **kwargs) -> Experiment:
    return load_experiment(write(tmp_path / "exp.yaml", experiment_text(plan, **kwargs)))


def test_gpus_must_match_product(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"dp\*tp\*pp\*cp = 1\*4\*4\*2 = 32 does not equal gpus=64; dp=2 would match",
    ):
        load_experiment("llama3-70b-h100", ["plan.dp=1"])
    assert load_experiment("llama3-70b-h100", ["plan.dp=1", "gpus=32"]).plan.n_gpus == 32


def test_tp_must_divide_heads_and_kv_heads(tmp_path):
    pattern = (
        r"kv_heads=8 is not divisible by tp=16; valid tp values dividing both heads=64 and "
        r"kv_heads=8: 1, 2, 4, 8"
    )
    with pytest.raises(ConfigError, match=pattern):
        load_with(tmp_path, "{tp: 16, pp: 4, global_batch: 64}")
    problems = check_plan(tiny_model(heads=8, kv_heads=8), load_cluster("dgx-h100"), PlanSpec(tp=3))
    assert any(re.search(r"heads=8 is not divisible by tp=3.*: 1, 2, 4, 8", p) for p in problems)


def test_layers_must_divide_pp_times_chunks(tmp_path):
    with pytest.raises(
        ConfigError,
        match=(
            r"n_layers=80 is not divisible by pp\*chunks = 3\*1 = 3; valid pp values for "
            r"chunks=1: 1, 2, 4, 5, 8, 10, 16, 20, 40, 80"
        ),
    ):
        load_with(tmp_path, "{tp: 8, pp: 3, global_batch: 64}")
    with pytest.raises(
        ConfigError,
        match=(
            r"n_layers=80 is not divisible by pp\*chunks = 4\*3 = 12; valid pp values for "
            r"chunks=3: none"
        ),
    ):
        load_with(tmp_path, "{tp: 8, pp: 4, global_batch: 64, schedule: interleaved, chunks: 3}")


def test_fractional_microbatches(tmp_path):
    pattern = (
        r"global_batch=100 is not divisible by dp\*microbatch = 4\*2 = 8: the number of "
        r"microbatches would be fractional \(12\.5\); nearest valid global_batch: 96 or 104"
    )
    with pytest.raises(ConfigError, match=pattern):
        load_with(tmp_path, "{tp: 4, pp: 4, dp: 4, microbatch: 2, global_batch: 100}")


def test_fewer_than_one_microbatch_is_an_error_even_when_lenient():
    plan = PlanSpec(dp=8, microbatch=2, global_batch=8)
    problems = check_plan(tiny_model(), load_cluster("dgx-h100"), plan, strict=False)
    assert any("fewer than one microbatch" in p and "global_batch=8" in p for p in problems)


def test_ep_without_moe(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"ep=2 needs a mixture-of-experts model, but model 'llama3-70b' has no moe",
    ):
        load_with(tmp_path, "{tp: 4, pp: 4, dp: 4, ep: 2, global_batch: 64}")


def test_ep_must_divide_dp_and_experts(tmp_path):
    with pytest.raises(ConfigError, match=r"ep=4 does not divide dp=2") as info:
        load_experiment("mixtral-8x7b", ["plan.dp=2", "plan.ep=4", "plan.tp=8", "plan.pp=4"])
    assert "dp*tp*pp*cp" not in str(info.value)
    moe = tiny_model(moe=MoeSpec(experts=6, top_k=2))
    problems = check_plan(moe, load_cluster("dgx-h100"), PlanSpec(dp=8, ep=4, global_batch=8))
    expected = "moe.experts=6 is not divisible by ep=4; valid ep values: 1, 2, 3, 6"
    assert expected in problems


def test_context_parallel_needs_2cp_chunks():
    model = tiny_model(seq_len=1000)
    problems = check_plan(model, load_cluster("dgx-h100"), PlanSpec(cp=8, global_batch=8))
    assert any(p.startswith("seq_len=1000 is not divisible by 2*cp = 16") for p in problems)
    assert check_plan(tiny_model(seq_len=1024), load_cluster("dgx-h100"), PlanSpec(cp=8)) == []


def test_precision_must_be_on_the_gpu(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"precision='bf16' has no peak on GPU 'V100-SXM2-32GB'.*this GPU has: fp16, fp32",
    ):
        load_with(tmp_path, "{tp: 8, global_batch: 8}", model="llama3-8b", cluster="generic-v100")
    fp16_model = "{base: llama3-8b, precision: fp16}"
    exp = load_with(tmp_path, "{tp: 8, global_batch: 8}", model=fp16_model, cluster="generic-v100")
    assert exp.model.precision == "fp16"


def test_gpus_must_fill_nodes():
    problems = check_plan(tiny_model(), load_cluster("dgx-h100"), PlanSpec(dp=12, global_batch=12))
    assert problems == [
        "dp*tp*pp*cp = 12 GPUs do not fit whole nodes of gpus_per_node=8 (cluster 'dgx-h100'): "
        "use a multiple of 8 or one of 1, 2, 4, 8"
    ]
    assert check_plan(tiny_model(), load_cluster("dgx-h100"), PlanSpec(dp=4, global_batch=4)) == []


def test_lenient_mode_skips_only_divisibility():
    model = load_model("llama3-405b")  # 126 layers: not divisible by pp*chunks = 32 or 128
    plan = PlanSpec(tp=8, pp=16, dp=2, schedule="interleaved", chunks=2, global_batch=31)
    cluster = load_cluster("dgx-h100")
    strict = check_plan(model, cluster, plan, n_gpus=256)
    assert any("n_layers=126" in p for p in strict) and any("global_batch=31" in p for p in strict)
    assert check_plan(model, cluster, plan, n_gpus=256, strict=False) == []
    assert check_plan(model, cluster, plan, n_gpus=512, strict=False) == [
        "dp*tp*pp*cp = 2*8*16*1 = 256 does not equal gpus=512; dp=4 would match"
    ]
    # Published Megatron-Bridge runs: 256 GPUs on 72-GPU NVL72 racks, pp*chunks = 16*8 > 126.
    nvl72 = load_cluster("dgx-gb300-nvl72")
    deep = dataclasses.replace(plan, chunks=8, global_batch=64)
    assert any("gpus_per_node=72" in p for p in check_plan(model, nvl72, deep))
    assert check_plan(model, nvl72, deep, n_gpus=256, strict=False) == []
    bad_heads = dataclasses.replace(deep, tp=3, dp=16)
    assert any("tp=3" in p for p in check_plan(model, nvl72, bad_heads, strict=False))


def test_validate_experiment_joins_all_problems():
    exp = Experiment(
        model=tiny_model(),
        cluster=load_cluster("dgx-h100"),
        plan=PlanSpec(tp=16, pp=3, dp=1, ep=2, global_batch=1),
        source="mine.yaml",
    )
    with pytest.raises(ConfigError) as info:
        validate_experiment(exp, n_gpus=64)
    message = str(info.value)
    assert message.startswith("mine.yaml: invalid plan:")
    for part in ("tp=16", "pp*chunks = 3*1 = 3", "ep=2", "= 48 does not equal gpus=64"):
        assert part in message
    validate_experiment(load_experiment("gpt3-175b"))  # a valid one raises nothing
