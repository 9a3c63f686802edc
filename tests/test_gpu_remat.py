"""benchmarks/gpu_remat.py: every variant of the step runs and is described, on the CPU."""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import jax
import pytest

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("gpu_remat", _DIR / "gpu_remat.py")
gr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gr)


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(gr, "CONFIG", ("GPT-tiny", 2, 32, 2, 64, 2))
    monkeypatch.setattr(gr.gm, "VOCAB", 128)
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        yield


def test_variants_written(tiny, tmp_path):
    assert gr.main(["--out", str(tmp_path), "--steps", "1", "--trace"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "remat.csv")))
    assert [(r["loop"], r["recompute"]) for r in rows] == list(gr.VARIANTS)
    assert all(float(r["step_s"]) > 0 and int(r["hlo_fusion"]) > 0 for r in rows)
    by = {(r["loop"], r["recompute"]): r for r in rows}
    # only the scan stacks the layers' residuals: one more while loop, and slices written
    scan, unrolled = by["scan", "none"], by["unrolled", "none"]
    for kind in ("hlo_while", "hlo_dynamic-update-slice"):
        assert int(scan[kind]) > int(unrolled[kind])
    # keeping everything for the backward takes more memory than recomputing the layer
    assert float(by["scan", "none"]["peak_mem_gib"]) > float(by["scan", "full"]["peak_mem_gib"])
    kernels = list(csv.DictReader(open(tmp_path / "kernels.csv")))
    assert {(k["loop"], k["recompute"]) for k in kernels} == set(gr.VARIANTS)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["rows"] == len(gr.VARIANTS) and meta["failures"] == []


def test_hlo_counts_reads_instruction_kinds():
    text = "\n".join(
        [
            "%fusion.1 = bf16[8,16]{1,0} fusion(bf16[8,16]{1,0} %p), kind=kLoop",
            "%while.2 = (s32[], bf16[4]{0}) while((s32[], bf16[4]{0}) %t), condition=%c",
            '%gemm = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"',
            "%copy.3 = bf16[8,16]{0,1} copy(bf16[8,16]{1,0} %fusion.1)",
        ]
    )
    got = gr.hlo_counts(text)
    assert (got["hlo_fusion"], got["hlo_while"], got["hlo_copy"], got["hlo_gemm"]) == (1, 1, 1, 1)
    assert got["hlo_attention"] == 0 and got["hlo_transpose"] == 0


def test_trace_kernels_sums_by_device_and_keeps_the_largest(monkeypatch):
    monkeypatch.setattr(gr, "TOP_KERNELS", 1)
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "gemm", "dur": 30.0},
        {"ph": "X", "pid": 1, "name": "gemm", "dur": 30.0},
        {"ph": "X", "pid": 1, "name": "copy", "dur": 10.0},
        {"ph": "X", "pid": 1, "name": "add", "dur": 4.0},
    ]
    assert gr.trace_kernels(events, 2) == [
        ("/device:GPU:0", "gemm", 1, 30.0),
        ("/device:GPU:0", "(other)", 1, 7.0),
    ]
