"""Command line: predict (table, --json, overrides, errors, Megatron flags), validate, and
commands contributed through the ``diffcost.commands`` entry points."""

import json
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from diffcost import cli
from diffcost.megatron_args import parse_megatron_args
from diffcost.validate import kendall_tau, validate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "configs" / "examples" / "gpt-1b-vtrain.yaml")
SAMPLE = Path(__file__).parent / "data" / "e2e_sample.csv"
JSON_KEYS = {"iteration_s", "tokens_per_s", "mfu", "breakdown", "memory_peak_bytes", "status"}


def _json(capsys, argv):
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_predict_json_has_documented_keys(capsys):
    d = _json(capsys, ["predict", EXAMPLE, "--json"])
    assert JSON_KEYS <= set(d)
    assert d["status"] == "ok"
    assert sum(d["breakdown"].values()) == pytest.approx(d["iteration_s"], rel=1e-5)


def test_predict_finds_a_shipped_example_by_file_name_from_any_directory(
    capsys, tmp_path, monkeypatch
):
    """A shipped example by file name outside the checkout, as the README's first command
    names ``gpt3-175b.yaml`` (the graph-model check must not read the name as a path), and a
    missing file is exit 2."""
    monkeypatch.chdir(tmp_path)
    d = _json(capsys, ["predict", Path(EXAMPLE).name, "--json"])
    assert d["status"] == "ok"
    assert cli.main(["predict", "no-such-experiment.yaml"]) == 2
    assert "not found" in capsys.readouterr().err


def test_predict_table_mentions_breakdown_and_verdict(capsys):
    assert cli.main(["predict", EXAMPLE]) == 0
    out = capsys.readouterr().out
    for word in ("iteration", "compute", "pipeline bubble", "memory per GPU", "fits"):
        assert word in out


def test_overrides_change_the_prediction(capsys):
    base = _json(capsys, ["predict", EXAMPLE, "--json"])
    bigger = _json(capsys, ["predict", EXAMPLE, "plan.global_batch=64", "--json"])
    assert bigger["iteration_s"] > base["iteration_s"]


def test_oom_verdict(capsys):
    d = _json(capsys, ["predict", EXAMPLE, "cluster.gpu.memory_GiB=2", "--json"])
    assert d["status"] == "oom"


def test_bad_input_is_a_clear_error_not_a_traceback(capsys):
    assert cli.main(["predict", EXAMPLE, "plan.tp=3"]) == 2
    err = capsys.readouterr().err
    assert "tp" in err and "3" in err
    assert cli.main(["predict", EXAMPLE, "plan.tpp=2"]) == 2
    assert "did you mean" in capsys.readouterr().err
    assert cli.main(["predict", "no/such/file.yaml"]) == 2


def test_megatron_args_parse_and_predict(capsys):
    args = (
        "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 "
        "--global-batch-size 64 --sequence-parallel --recompute-granularity selective "
        "--use-distributed-optimizer --bf16 --num-layers-per-virtual-pipeline-stage 6 --lr 1e-4"
    )
    model, plan, ignored = parse_megatron_args(args, n_gpus=16)
    assert (plan.tp, plan.pp, plan.dp, plan.chunks, plan.zero) == (2, 2, 4, 2, 1)
    assert plan.schedule == "interleaved" and plan.sequence_parallel
    assert plan.recompute == "selective" and model.ffn_hidden == 4 * 2048
    assert ignored == ["--lr"]
    d = _json(
        capsys,
        ["predict", "--megatron-args", args, "--cluster", "dgx-h100", "--gpus", "16", "--json"],
    )
    assert d["n_gpus"] == 16 and d["status"] == "ok"


@pytest.mark.parametrize(
    "flags,fp32",
    [
        ("--bf16", True),  # Megatron forces fp32 accumulation and reduction with bf16
        ("--bf16 --grad-reduce-in-bf16", False),
        ("--fp16", False),
        ("--fp16 --accumulate-allreduce-grads-in-fp32", True),
    ],
)
def test_megatron_args_gradient_precision(flags, fp32):
    base = "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
    _, plan, ignored = parse_megatron_args(base + flags, n_gpus=2)
    assert plan.grad_reduce_fp32 is fp32 and ignored == []


@pytest.mark.parametrize(
    "flags, share",
    [
        ("--recompute-granularity full", 1.0),
        ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", 1.0),
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 2", 0.5),
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 9", 1.0),
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 0", 1.0),
    ],
)
def test_megatron_args_block_recompute_covers_n_layers_per_stage(flags, share):
    """8 layers on 2 stages: block recompute of 2 layers per stage is half the layers; of 0
    layers, no recompute."""
    base = "--num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
    _, plan, ignored = parse_megatron_args(base + "--pipeline-model-parallel-size 2 " + flags, 4)
    mode = "none" if flags.endswith(" 0") else "full"
    assert (plan.recompute, plan.recompute_fraction, ignored) == (mode, share, [])


def test_megatron_args_errors():
    with pytest.raises(ValueError, match="--num-layers"):
        parse_megatron_args("--hidden-size 1024", n_gpus=8)
    with pytest.raises(ValueError, match="not divisible"):
        parse_megatron_args(
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
            "--tensor-model-parallel-size 3",
            n_gpus=8,
        )
    with pytest.raises(ValueError, match="--micro-batch-size"):
        parse_megatron_args(
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
            "--micro-batch-size x",
            n_gpus=8,
        )


def test_validate_reports_rows_sources_and_skips():
    out = validate(SAMPLE)
    s = out["summary"]
    assert s["rows"] == len(out["rows"]) == 18
    assert s["predicted"] + s["skipped"] == s["rows"]
    reasons = {r["source"]: r["skipped"] for r in out["rows"] if r["skipped"]}
    assert "architecture not given" in reasons["nvadlr_megatronlm_v1_blog"]
    assert "no-such-cluster" in reasons["synthetic_bad_cluster"]
    vtrain = [r for r in out["rows"] if r["source"] == "vtrain_ground_truth_single"]
    assert all(r["predicted_iter_s"] > 0 and r["ape_pct"] is not None for r in vtrain)
    assert any("vocab=50257" in d for d in vtrain[0]["defaults"])
    assert set(out["by_source"]["vtrain_ground_truth_single"]) == {
        "rows",
        "predicted",
        "skipped",
        "mape_pct",
        "max_ape_pct",
        "kendall_tau",
        "coverage_pct",
        "median_width_pct",
        "time_rows",
        "mem_rows",
        "mem_mape_pct",
        "mem_max_ape_pct",
    }


def test_validate_json_cli(capsys):
    d = _json(capsys, ["validate", str(SAMPLE), "--json"])
    row = d["rows"][0]
    assert {"row", "source", "measured_iter_s", "predicted_iter_s", "ape_pct", "skipped"} <= set(
        row
    )


def test_validate_malformed_csv(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="bad.csv: line 1: missing columns"):
        validate(bad)


def test_kendall_tau():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1], [1]) is None


def test_calibrate_is_a_plugin_command():
    from calibration import cli as calibration_cli

    assert dict(cli.plugin_commands())["calibrate"] is calibration_cli.register
    args = cli.build_parser().parse_args(["calibrate", "--cluster", "dgx-h100", "x.csv"])
    assert args.func is calibration_cli.run and args.steps is None  # FitConfig.steps at run


def test_calibrate_help_states_the_fit_step_limit(capsys):
    """The plugin does not import the fit, so its help writes the default out: it must be
    ``FitConfig.steps``."""
    from calibration.fit import FitConfig

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["calibrate", "--help"])
    assert f"(default: FitConfig.steps, {FitConfig().steps})" in " ".join(
        capsys.readouterr().out.split()
    )


def test_without_plugins_there_is_no_calibrate(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser(plugins=[]).parse_args(["calibrate", "--cluster", "dgx-h100", "x.csv"])
    assert "invalid choice: 'calibrate'" in capsys.readouterr().err


def test_a_broken_plugin_is_reported_and_left_out(monkeypatch, capsys):
    broken = EntryPoint(name="broken", value="no_such_module:register", group=cli.ENTRY_POINT_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken])
    assert cli.plugin_commands() == []
    assert "command plugin 'broken'" in capsys.readouterr().err
    assert cli.main(["predict", EXAMPLE, "--json"]) == 0
