"""MLPerf Training v4.0 rows: the reader, the rows as training runs, non-causal attention."""

import csv
import dataclasses

import jax
import numpy as np
import pytest
from helpers import CLUSTER, GPT, PLANS, SHARED_DATA, arrays

from calibration import mlperf
from calibration import mlperf_fit as fit
from calibration.mlperf_fit import submitter_halves
from calibration.mlperf_models import GraphRecord, zoo_graph_arrays, zoo_param_count
from calibration.mlperf_rows import GraphRows
from calibration.records import E2ERecord, ReaderError
from diffcost import config, default_params, kernels, workload
from diffcost.arrays import cluster_arrays
from diffcost.opgraph.data_parallel import data_parallel_step_s
from diffcost.profiles import params_for
from diffcost.specs import PlanSpec

MLPERF_CSV = SHARED_DATA / "e2e" / "mlperf_training_v4.0.csv"
needs_data = pytest.mark.skipif(not MLPERF_CSV.is_file(), reason="shared data not found")


# --- non-causal attention ---------------------------------------------------------------------


def _attention(model, plan_name="single"):
    m, p, c = arrays(model, PLANS[plan_name])
    work = workload.layer_work(m, p)
    return m, p, kernels.kernel_times(work, m, c, default_params(), 1e-3).attention_s


def test_non_causal_fused_attention_computes_the_whole_square():
    # long sequences keep the fused kernel compute-bound: the time follows the FLOPs executed
    causal = dataclasses.replace(GPT, seq_len=16384)
    encoder = dataclasses.replace(causal, causal=False)
    m, p, t_causal = _attention(causal)
    m_enc, _, t_enc = _attention(encoder)
    np.testing.assert_allclose(np.asarray(t_enc) / np.asarray(t_causal), 2.0, rtol=1e-3)
    # model FLOPs count the whole square either way (Narayanan et al.'s convention)
    assert float(workload.model_flops_per_iteration(m_enc, p)) == float(
        workload.model_flops_per_iteration(m, p)
    )


def test_unfused_attention_is_the_same_for_causal_and_non_causal():
    causal = dataclasses.replace(GPT, attention="unfused")
    _, _, t_causal = _attention(causal)
    _, _, t_enc = _attention(dataclasses.replace(causal, causal=False))
    np.testing.assert_array_equal(np.asarray(t_enc), np.asarray(t_causal))


def test_a_masked_lm_head_runs_on_its_fraction_of_the_tokens():
    m, p, c = arrays(GPT, PLANS["single"])
    part = dataclasses.replace(GPT, head_tokens=0.25)
    m4, _, _ = arrays(part, PLANS["single"])
    params = default_params()
    full = kernels.kernel_times(workload.layer_work(m, p), m, c, params, 1e-3)
    quarter = kernels.kernel_times(workload.layer_work(m4, p), m4, c, params, 1e-3)
    # the loss is memory-bound over the logits: exactly a quarter of them
    np.testing.assert_allclose(np.asarray(quarter.loss_s), 0.25 * np.asarray(full.loss_s))
    ratio = np.asarray(quarter.head_s) / np.asarray(full.head_s)
    assert ((ratio > 0.24) & (ratio < 0.3)).all()  # GEMM efficiency falls a little with m
    np.testing.assert_array_equal(np.asarray(quarter.layer_s), np.asarray(full.layer_s))


def test_head_tokens_must_be_a_fraction():
    with pytest.raises(config.ConfigError, match=r"model.head_tokens=1.5 is invalid.*\(0, 1\]"):
        config.load_experiment("gpt3-175b", ["model.head_tokens=1.5"])


# --- reader -------------------------------------------------------------------------------------


@needs_data
def test_reads_every_row_and_represents_six_benchmarks():
    rows, meas = mlperf.load(MLPERF_CSV)
    assert len(rows) == 141
    benchmarks = [r.source_name.split("/")[-1] for r in meas.e2e]
    for b in ("bert", "llama2_70b_lora", "resnet", "ssd"):
        assert benchmarks.count(b) == sum(r.benchmark == b for r in rows), b
    # one DLRM row's step is not set by its GPUs (mlperf.NOT_REPRESENTED_ROWS)
    assert benchmarks.count("dlrm_dcnv2") == sum(r.benchmark == "dlrm_dcnv2" for r in rows) - 1
    assert len(meas.e2e) + len(meas.skipped) == len(rows)
    for _, why in meas.skipped:
        bench = why.split(":")[0]
        if bench == "unet3d":  # 72 and 768 GPUs at 56 and 84 samples: spatial parallelism
            assert "spatial parallelism" in why
            continue
        if why.endswith(tuple(mlperf.NOT_REPRESENTED_ROWS.values())):
            continue
        assert bench in mlperf.NOT_REPRESENTED and why.endswith(mlperf.NOT_REPRESENTED[bench])
    assert benchmarks.count("unet3d") == sum(r.benchmark == "unet3d" for r in rows) - 3
    for r in meas.e2e:
        n_gpus = r.plan.n_gpus if isinstance(r, E2ERecord) else r.n_gpus
        assert n_gpus == rows[r.row - 1].n_gpus
        per_gpu = r.source_name.endswith("/ssd")  # the log's throughput is per GPU
        assert r.measured_iter_s == rows[r.row - 1].iter_s / (n_gpus if per_gpu else 1)


@needs_data
def test_rows_become_the_implementations_plans():
    rows, meas = mlperf.load(MLPERF_CSV)
    by_system = {(rows[r.row - 1].system, r.source_name.split("/")[-1]): r for r in meas.e2e}
    bert = by_system[("eos_n8_ngc23.04_pytorch", "bert")]
    assert (bert.plan.dp, bert.plan.microbatch, bert.plan.global_batch) == (64, 72, 4608)
    assert not bert.model.causal and bert.model.seq_len == mlperf.UNPADDED_SEQ_LEN
    lora = by_system[("eos_n8_ngc24.04_nemo", "llama2_70b_lora")]
    assert (lora.plan.tp, lora.plan.cp, lora.plan.dp) == (4, 2, 8)
    assert lora.plan.lora_rank == 16 and lora.model.seq_len == 8192
    assert lora.model.precision == "fp8" and lora.stack == "megatron-core"
    # the H200 row's tp cell contradicts its accumulation (2 steps of 8 samples: dp 4)
    h200 = by_system[("h200_ngc24.04_nemo", "llama2_70b_lora")]
    assert (h200.plan.tp, h200.plan.dp) == (2, 4)
    assert any("contradict" in d for d in h200.defaults)
    assert lora.cluster.name == "dgx-h100" and h200.cluster.name == "dgx-h200"
    assert bert.plan.cuda_graphs
    resnet = by_system[("eos_n8_ngc24.04_mxnet", "resnet")]
    assert (resnet.n_gpus, resnet.local_batch, resnet.zoo_model) == (64, 50, "resnet50")
    ssd = by_system[("eos_ngc24.04_pytorch", "ssd")]
    assert (ssd.n_gpus, ssd.local_batch, ssd.zoo_model) == (8, 32, "retinanet")
    # NVIDIA's SSD logs throughput per GPU: one step of 256 images is 1/8 of the CSV's iter_s
    row = rows[ssd.row - 1]
    assert ssd.measured_iter_s == pytest.approx(row.global_batch / (8 * row.samples_per_s))
    assert any("per GPU" in d for d in ssd.defaults)
    dlrm = by_system[("eos_n16_ngc24.04_merlin_hugectr", "dlrm_dcnv2")]
    assert (dlrm.n_gpus, dlrm.spec.batch_size, len(dlrm.spec.tables)) == (128, 135168, 26)
    # HugeCTR's mixed precision: 16-bit embedding exchange and gradient all-reduce, fp32 tables
    assert (dlrm.spec.exchange_bytes, dlrm.spec.grad_bytes, dlrm.spec.embedding_bytes) == (2, 2, 4)
    assert any("includes evaluation" in d for d in dlrm.defaults)


def _write(tmp_path, edit):
    """A copy of the first 5 rows of the MLPerf CSV with ``edit(header, rows)`` applied."""
    with open(MLPERF_CSV, newline="", encoding="utf-8") as fh:
        data = list(csv.reader(fh))
    header, rows = data[0], data[1:6]
    edit(header, rows)
    path = tmp_path / "mlperf.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([header, *rows])
    return path


def _set(col, value, row=2):
    def edit(header, rows):
        rows[row][header.index(col)] = value

    return edit


@needs_data
@pytest.mark.parametrize(
    "edit,message",
    [
        (_set("samples_per_s", "fast"), r"mlperf.csv:4: column 'samples_per_s': not a number"),
        (_set("benchmark", "gpt3"), r":4: column 'benchmark': 'gpt3' is not one of resnet, bert"),
        (_set("iter_s_median", "0.5"), r":4: column 'iter_s_median': 0.5 is not global_batch"),
        (_set("n_accelerators", "16"), r":4: column 'n_accelerators': 16 is not n_nodes"),
        (_set("notes", "10 runs"), r":4: column 'notes': '10 runs' has no 'gradient_accum"),
        (_set("global_batch_size", ""), r":4: column 'global_batch_size' is blank"),
        (_set("tp", "0"), r":4: column 'tp': 0 is not a positive integer"),
    ],
)
def test_reader_errors_name_the_file_line_column_and_value(tmp_path, edit, message):
    with pytest.raises(ReaderError, match=message):
        mlperf.read_mlperf_csv(_write(tmp_path, edit))


@needs_data
def test_reader_names_missing_columns(tmp_path):
    def drop(header, rows):
        i = header.index("samples_per_s")
        for cells in [header, *rows]:
            del cells[i]

    with pytest.raises(ReaderError, match=r"mlperf.csv:1: missing required .*samples_per_s"):
        mlperf.read_mlperf_csv(_write(tmp_path, drop))


@needs_data
def test_unknown_accelerators_are_not_represented(tmp_path):
    path = _write(tmp_path, _set("accelerator", "NVIDIA B200", row=0))
    row = mlperf.read_mlperf_csv(path)[0]
    assert row.benchmark == "bert"
    with pytest.raises(mlperf.NotRepresented, match="no cluster preset for accelerator"):
        mlperf.to_record(row)


def test_submitter_halves_keep_each_submitter_on_one_side():
    subs = ["a", "a", "b", "c", "c", "c", "d", "e", "e", "f"]
    halves = submitter_halves(subs)
    for s in set(subs):
        assert len({h for x, h in zip(subs, halves) if x == s}) == 1
    sizes = np.bincount(halves, minlength=2)
    assert abs(sizes[0] - sizes[1]) <= 3  # the largest submitter's rows
    assert (halves == submitter_halves(subs)).all()  # seeded


def test_a_gpu_shares_the_family_offset_of_its_parent_die():
    presets = ("dgx-h200", "dgx-h100", "pcie-l40s")
    records = [
        E2ERecord(GPT, PLANS["dp8"], config.load_cluster(c), 1.0, "synthetic", i, (), None)
        for i, c in enumerate(presets)
    ]
    family, families = fit.families_of(records)
    assert families == ("h100", "l40")  # the H200 is the H100's die (gpus.FAMILY_PARENT)
    assert list(family) == [0, 0, 1]


# one compiled program per set of rows, not an eager trace per call (each compiled hundreds of
# primitives one by one)
_predict_log = jax.jit(fit.predict_log)


def test_the_fit_recovers_offsets_that_generated_the_times():
    """Rows whose 'measured' times are the model's own at known offsets: the fit on half of
    them removes at least half of the error on every row, held out or not (the priors, two
    widths from these offsets, keep the rest with two training rows), and with no training
    rows the offsets stay at 0."""
    plans = [PlanSpec(dp=d, microbatch=mb, global_batch=d * mb) for d, mb in [(8, 4), (4, 16)]]
    plans += [dataclasses.replace(p, microbatch=2 * p.microbatch) for p in plans]
    plans = [dataclasses.replace(p, global_batch=p.dp * p.microbatch) for p in plans]
    records = [
        E2ERecord(GPT, p, CLUSTER, 1.0, "synthetic", i, (), None) for i, p in enumerate(plans)
    ]
    rows = fit.Rows.of(records)
    truth = np.zeros(rows.n_offsets)
    truth[fit.LEAVES.index("gemm_eff_logit")] = 1.0
    truth[fit.LEAVES.index("host_op_log_s")] = -1.0
    rows = rows.replace(log_meas=np.asarray(_predict_log(rows, truth)))
    settings = fit.FitSettings(steps=150, learning_rate=0.05)
    step = fit.make_step(settings)
    train = np.array([1.0, 1.0, 0.0, 0.0])
    raw = fit.fit_offsets(rows, train, settings, step)
    resid = np.abs(np.asarray(_predict_log(rows, raw)) - np.asarray(rows.log_meas))
    before = np.abs(np.asarray(_predict_log(rows, np.zeros(rows.n_offsets))) - rows.log_meas)
    assert before.min() > 0.08  # the offsets matter
    assert resid.max() < 0.5 * before.min()
    assert resid[2:].max() < 1.5 * resid[:2].max()  # held out as good as fitted
    np.testing.assert_array_equal(fit.fit_offsets(rows, np.zeros(4), settings, step), 0.0)


def test_a_family_step_compute_offset_moves_its_family_past_the_efficiency_cap():
    """The per-family ``step_compute`` offset speeds its own family's rows only, and further
    than any GEMM-efficiency offset can (an efficiency is at most 1 of ``step_compute`` times
    the peak)."""
    presets = ("dgx-h100", "pcie-l40s")
    records = [
        E2ERecord(GPT, PLANS["dp8"], config.load_cluster(c), 1.0, "synthetic", i, (), None)
        for i, c in enumerate(presets)
    ]
    rows = fit.Rows.of(records)
    n, h100 = len(fit.LEAVES), rows.families.index("h100")
    assert [e.leaf for e in fit.FAMILY_EFFECTS] == ["gemm_eff_logit", "step_compute_log"]
    capped, lifted = np.zeros(rows.n_offsets), np.zeros(rows.n_offsets)
    capped[n + h100] = 20.0  # GEMM efficiency 1
    lifted[n + len(rows.families) + h100] = np.log(2.0)
    base, capped, lifted = (
        np.asarray(_predict_log(rows, r)) for r in (np.zeros_like(capped), capped, lifted)
    )
    assert lifted[0] < capped[0] < base[0]
    assert lifted[1] == base[1] and capped[1] == base[1]


def test_graph_rows_price_each_row_as_its_data_parallel_step():
    """``GraphRows`` at zero offsets is ``data_parallel_step_s`` of each row on its shipped
    profile; the fit's offsets move it (a faster memory-bound pass shortens every row)."""
    cluster = config.load_cluster("dgx-h100")
    records = [
        GraphRecord("resnet", "small_cnn", cluster, n, b, 0.01, "synthetic", i, (), None)
        for i, (n, b) in enumerate([(8, 16), (64, 4)])
    ]
    rows = GraphRows.of(records)
    got = np.exp(np.asarray(_predict_log(rows, np.zeros(rows.n_offsets))))
    n_params = zoo_param_count("small_cnn")
    for r, t in zip(records, got):
        step = data_parallel_step_s(
            zoo_graph_arrays("small_cnn", r.local_batch),
            float(r.n_gpus),
            n_params,
            2.0 * n_params,
            cluster_arrays(cluster),
            params_for(cluster)[0],
            1e-3,
        )
        np.testing.assert_allclose(t, step.iteration_s, rtol=1e-9)
    raw = np.zeros(rows.n_offsets)
    raw[fit.LEAVES.index("mem_eff_logit")] = 1.0
    assert (np.asarray(_predict_log(rows, raw)) < np.log(got)).all()


def test_retinanet_graph_has_the_same_operators_at_every_batch():
    """``GraphRows`` stacks one graph per row: the detector's operators (and so the arrays'
    shapes) must not depend on the batch, a batch of one included (2,528 GPUs)."""
    one, four = zoo_graph_arrays("retinanet", 1), zoo_graph_arrays("retinanet", 4)
    assert one.gemm.shape == four.gemm.shape
    np.testing.assert_array_equal(np.asarray(four.is_gemm), np.asarray(one.is_gemm))
    # the same GEMMs in the same order (a convolution's group count does not depend on the
    # batch; its m, or a weight gradient's k, does)
    np.testing.assert_array_equal(np.asarray(four.gemm)[:, 0], np.asarray(one.gemm)[:, 0])
