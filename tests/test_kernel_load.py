"""Kernel tables timed under sustained load (SimuMax column ``load``): read, timed at a training
step's rate in the fit, and kernel rows of GPU families without a preset reported, not dropped."""

import csv
from pathlib import Path

import jax.numpy as jnp
import pytest

from calibration import fit as F
from calibration import kernel_levels
from calibration.readers import load
from calibration.records import GemmRecord, Measurements, ReaderError, Source, placed_kernels
from diffcost.arrays import cluster_arrays
from diffcost.config import load_cluster
from diffcost.params import default_params
from diffcost.specs import PRECISIONS
from diffcost.workload import attention_shape

H200 = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "h200" / "kernels.csv"


def _copy(tmp_path, load_value=None, drop=False):
    """The H200 kernel table with every 'load' cell set to ``load_value`` (or the column
    dropped)."""
    with open(H200, newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = list(reader.fieldnames), list(reader)
    if drop:
        header.remove("load")
    for r in rows:
        r.pop("load") if drop else r.update(load=load_value)
    path = tmp_path / "kernels.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, header)
        w.writeheader()
        w.writerows(rows)
    return path


def test_measured_table_reads_as_sustained(tmp_path):
    meas = load([H200])
    kernels = meas.gemms + meas.attention
    assert len(kernels) == 77 and all(r.sustained for r in kernels)
    for path in (_copy(tmp_path, drop=True), _copy(tmp_path, "burst"), _copy(tmp_path, "")):
        again = load([path])
        assert not any(r.sustained for r in again.gemms + again.attention)


def test_bad_load_value_names_file_line_column_and_choices(tmp_path):
    path = _copy(tmp_path, "hot")
    with pytest.raises(ReaderError) as err:
        load([path])
    text = str(err.value)
    assert text.startswith(f"{path}:2:") and "'load'" in text and "'hot'" in text
    assert "burst, sustained" in text


def _with_step(step):
    p = default_params()
    return p.replace(step_compute_log=jnp.log(jnp.asarray(step, p.step_compute_log.dtype)))


@pytest.mark.parametrize("step", [1.0, 0.5])
def test_sustained_kernels_run_at_the_training_step_rate(step):
    cluster = cluster_arrays(load_cluster("dgx-h200"))
    p = _with_step(step)
    bf16 = jnp.eye(len(PRECISIONS))[PRECISIONS.index("bf16")]
    big = (16384.0, 16384.0, 16384.0)  # compute-bound: the per-kernel gap is negligible

    def gemm(sustained):
        return float(kernel_levels.gemm_time(*big, bf16, sustained, cluster, p, 0.0, 1e-3))

    shape = attention_shape(8192.0, 128.0, 32.0, 1.0)

    def attn(sustained):
        args = (4e13, 1e9, shape, 0, sustained, cluster, p, 1e-3)
        return float(kernel_levels.attention_time(*args))

    for time in (gemm, attn):
        assert time(1.0) / time(0.0) == pytest.approx(1.0 / step, rel=2e-3)


def test_kernels_of_families_without_a_preset_are_reported():
    where = Source(Path("k.csv"), 2)
    rows = [GemmRecord(g, 1, 4096, 4096, 4096, "bf16", 1e-3, where) for g in ("h200", "tpu-v9")]
    out = placed_kernels(Measurements(gemms=rows))
    assert [g.gpu for g in out.gemms] == ["h200"]
    assert len(out.skipped) == 1
    place, reason = out.skipped[0]
    assert place == where and "tpu-v9" in reason and "h200" in reason


def test_build_problem_warns_about_kernels_it_leaves_out():
    where = Source(Path("k.csv"), 7)
    rows = [GemmRecord(g, 1, 4096, 4096, 4096, "bf16", 1e-3, where) for g in ("h100", "tpu-v9")]
    with pytest.warns(UserWarning, match=r"1 kernel rows left out: k.csv:7: kernel of tpu-v9"):
        problem = F.build_problem(Measurements(gemms=rows))
    assert problem.counts["gemm"] == 1
