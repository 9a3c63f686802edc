"""diffcost validate with measured peak memory: reading the column, the rows' and summaries'
memory figures, memory-only rows and the tables."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from diffcost import cli
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays
from diffcost.profiles import params_for
from diffcost.runs import read_rows, row_to_specs
from diffcost.simulate import RUNTIME_RESERVE_BYTES, simulate
from diffcost.validate import GIB, validate

E2E = Path(__file__).parent / "data" / "readers_e2e.csv"  # 3 predictable rows, then 3 others
MEM = "measured_peak_mem_gib"


def _write(path: Path, mem: list[str], times: dict[int, str] | None = None) -> Path:
    """``E2E`` with a ``measured_peak_mem_gib`` column holding ``mem`` (one cell per data row)
    and the ``measured_iter_s`` cells of the 1-based rows in ``times`` replaced."""
    with open(E2E, newline="") as fh:
        header, *rows = list(csv.reader(fh))
    t = header.index("measured_iter_s")
    for i, cell in (times or {}).items():
        rows[i - 1][t] = cell
    rows = [[*row, cell] for row, cell in zip(rows, mem, strict=True)]
    with open(path, "w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows([[*header, MEM], *rows])
    return path


@pytest.fixture(scope="module")
def predicted_gib() -> list[float]:
    """The predicted peaks of the three predictable rows, from a file without the column."""
    return [r["predicted_peak_mem_gib"] for r in validate(E2E)["rows"][:3]]


@pytest.mark.parametrize(
    "value, why",
    [
        ("lots", "not a number: 'lots'"),
        ("nan", "not a finite number: 'nan'"),
        ("inf", "not a finite number: 'inf'"),
        ("0", "not a positive number: '0'"),
        ("-3.5", "not a positive number: '-3.5'"),
    ],
)
def test_bad_memory_cells_name_file_line_and_column(tmp_path, value, why):
    path = _write(tmp_path / "runs.csv", ["", value, "", "", "", ""])
    with pytest.raises(ValueError) as e:
        validate(path)
    assert str(e.value) == f"{path}: line 3: column '{MEM}': {why}"


def test_good_and_blank_cells_are_read(tmp_path):
    rows = read_rows(_write(tmp_path / "runs.csv", ["41.5", "", " 7 ", "", "", ""]))
    assert [r[MEM] for r in rows] == ["41.5", "", "7", "", "", ""]
    out = validate(tmp_path / "runs.csv")["rows"]
    assert [r[MEM] for r in out] == [41.5, None, 7.0, None, None, None]


def test_every_predicted_row_has_its_allocated_peak(tmp_path):
    """``predicted_peak_mem_gib`` is the largest existing stage's total without the runtime
    reserve (which ``torch.cuda.max_memory_allocated`` does not see), for every predicted row,
    with or without a measurement; skipped rows have none."""
    out = validate(E2E)
    cache: dict = {}
    rows = read_rows(E2E)
    for r in out["rows"]:
        if r["skipped"]:
            assert r["predicted_peak_mem_gib"] is None and r["mem_ape_pct"] is None
            continue
        model, plan, cluster, _ = row_to_specs(rows[r["row"] - 1], cache)
        params, _ = params_for(cluster, None)
        b = simulate(model_arrays(model), plan_arrays(plan), cluster_arrays(cluster), params, 0.0)
        stages = np.asarray(b.memory_stage_bytes)[: 2 if plan.pp > 1 else 1]
        expected = (stages.max() - RUNTIME_RESERVE_BYTES) / GIB
        assert r["predicted_peak_mem_gib"] == pytest.approx(expected, rel=2e-3)
        assert r["mem_ape_pct"] is None  # no measurement in this file


def test_memory_errors_follow_from_the_measurements(tmp_path, predicted_gib):
    """Measured peaks set to known multiples of the predictions give known errors: APE
    ``|1 - k| / k``, their mean and maximum per source and overall; the time figures do not
    move."""
    factors = [1.25, 0.8, None]  # row 3 has no memory measurement
    cells = [f"{p * k!r}" if k else "" for p, k in zip(predicted_gib, factors)] + [""] * 3
    out = validate(_write(tmp_path / "runs.csv", cells))
    plain = validate(E2E)
    apes = [abs(1.0 - k) / k * 100.0 for k in factors[:2]]
    got = [r["mem_ape_pct"] for r in out["rows"]]
    np.testing.assert_allclose(got[:2], apes, rtol=1e-9)
    assert got[2:] == [None] * 4
    s = out["summary"]
    assert s["mem_rows"] == 2
    assert s["mem_mape_pct"] == pytest.approx(np.mean(apes), rel=1e-9)
    assert s["mem_max_ape_pct"] == pytest.approx(max(apes), rel=1e-9)
    by = out["by_source"]
    assert by["vtrain_ground_truth_single"]["mem_mape_pct"] == pytest.approx(apes[0], rel=1e-9)
    assert by["mosaicml_llmfoundry_benchmarks"]["mem_rows"] == 1
    assert by["nemo_perf_summary_24.07"]["mem_mape_pct"] is None
    assert by["nemo_perf_summary_24.07"]["mem_rows"] == 0
    time_keys = ("rows", "predicted", "skipped", "mape_pct", "max_ape_pct", "kendall_tau")
    assert {k: s[k] for k in time_keys} == {k: plain["summary"][k] for k in time_keys}
    assert [r["predicted_peak_mem_gib"] for r in out["rows"][:3]] == predicted_gib


def test_a_row_with_memory_and_no_time_is_predicted_for_memory_only(tmp_path, predicted_gib):
    """Row 1 without a time and row 2 with a zero time, both with a measured peak: predicted
    (time and memory), counted in the memory figures and in no time figure. Row 6 has neither
    measurement and stays skipped."""
    cells = [f"{predicted_gib[0] * 2.0!r}", f"{predicted_gib[1]!r}", "", "", "", ""]
    out = validate(_write(tmp_path / "runs.csv", cells, times={1: "", 2: "0"}))
    r1, r2, r3 = out["rows"][:3]
    assert r1["skipped"] is None and r1["measured_iter_s"] is None and r1["ape_pct"] is None
    assert r1["predicted_iter_s"] > 0
    assert r1["mem_ape_pct"] == pytest.approx(50.0, rel=1e-9)
    assert r2["skipped"] is None and r2["measured_iter_s"] == 0.0 and r2["ape_pct"] is None
    assert r2["mem_ape_pct"] == pytest.approx(0.0, abs=1e-9)
    assert r3["ape_pct"] is not None
    assert out["rows"][5]["skipped"] == "measured_iter_s blank"
    s = out["summary"]
    assert (s["rows"], s["predicted"], s["skipped"], s["time_rows"], s["mem_rows"]) == (
        6,
        3,
        3,
        1,
        2,
    )
    assert s["mape_pct"] == pytest.approx(r3["ape_pct"], rel=1e-12)
    assert s["kendall_tau"] is None  # one timed row


def test_tables_show_memory_columns_only_with_measurements(
    tmp_path, capsys, monkeypatch, predicted_gib
):
    monkeypatch.setenv("COLUMNS", "300")  # every header in full
    assert cli.main(["validate", str(E2E), "--rows"]) == 0
    assert "mem MAPE" not in capsys.readouterr().out
    cells = [f"{predicted_gib[0] * 1.25!r}", "", "", "", "", ""]
    path = _write(tmp_path / "runs.csv", cells, times={1: ""})
    assert cli.main(["validate", str(path), "--rows"]) == 0
    text = capsys.readouterr().out
    assert "mem MAPE" in text and "predicted GiB" in text
    assert "20.0" in text  # row 1: |1 - 1.25| / 1.25
    assert cli.main(["validate", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["mem_ape_pct"] == pytest.approx(20.0, rel=1e-9)
    assert all(r["predicted_peak_mem_gib"] > 0 for r in rows[:3])
