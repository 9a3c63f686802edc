"""diffcost validate: which rows count in the errors, and which files are refused."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from diffcost import cli
from diffcost.runs import E2E_COLUMNS, read_rows, row_to_specs
from diffcost.validate import validate

E2E = Path(__file__).parent / "data" / "readers_e2e.csv"  # 3 predictable rows, then 3 others


def _write(path: Path, edit=None) -> Path:
    """``E2E`` copied to ``path``, with ``edit(header, rows)`` applied to its cells."""
    with open(E2E, newline="") as fh:
        header, *rows = list(csv.reader(fh))
    if edit is not None:
        edit(header, rows)
    with open(path, "w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows([header, *rows])
    return path


def _set(column: str, row: int, value: str):
    def edit(header, rows):
        rows[row - 1][header.index(column)] = value

    return edit


def test_non_positive_times_are_skipped_not_counted(tmp_path):
    """A zero or negative measured time is no measurement: the row is skipped with the value,
    and the errors are those of the other rows."""
    good = validate(
        _write(tmp_path / "good.csv", lambda h, rows: rows.__setitem__(slice(3, 6), []))
    )

    def add_bad_times(header, rows):
        del rows[3:]
        col = header.index("measured_iter_s")
        rows += [[*rows[0][:col], t, *rows[0][col + 1 :]] for t in ("-0.5", "0", "-0")]

    out = validate(_write(tmp_path / "bad.csv", add_bad_times))
    skipped = [(r["row"], r["skipped"]) for r in out["rows"][3:]]
    assert skipped == [
        (4, "measured_iter_s -0.5 is not a positive time"),
        (5, "measured_iter_s 0 is not a positive time"),
        (6, "measured_iter_s -0 is not a positive time"),
    ]
    assert all(r["ape_pct"] is None and r["predicted_iter_s"] is None for r in out["rows"][3:])
    assert out["summary"] == {**good["summary"], "rows": 6, "skipped": 3}
    assert out["summary"]["predicted"] == 3


def test_megatron_deepspeed_rows_reduce_16_bit_gradients():
    """vTrain's Megatron-DeepSpeed rows default to 2-byte gradients and say so; the
    Megatron-Core (NeMo) row keeps fp32 and lists nothing about it."""
    rows = validate(E2E)["rows"]
    assert "grad_reduce_fp32=False" in rows[0]["defaults"]
    assert not any("grad_reduce_fp32" in d for d in rows[2]["defaults"])


def test_megatron_bridge_rows_reduce_bf16_gradients():
    """Megatron-Bridge's performance recipes set grad_reduce_in_fp32 = False: a Bridge row
    reduces 2-byte gradients and says so; the same row in NeMo keeps fp32."""
    row = dict(read_rows(E2E)[2], framework="Megatron-Bridge (Megatron-Core)")
    _, plan, _, used = row_to_specs(row, {})
    assert not plan.grad_reduce_fp32 and "grad_reduce_fp32=False" in used
    _, plan, _, used = row_to_specs(read_rows(E2E)[2], {})
    assert plan.grad_reduce_fp32 and "grad_reduce_fp32=False" not in used


@pytest.mark.parametrize(
    "framework, expected",
    [("torchtitan (PyTorch FSDP2)", ("full", 0.5)), ("NeMo", ("selective", 1.0))],
)
def test_selective_recompute_is_what_the_stack_replays(framework, expected):
    """torchtitan's selective activation checkpointing replays about half of every block's
    forward (full recompute on half the layers, said in the row's defaults); in a Megatron-Core
    stack "selective" stays the attention-core recompute."""
    row = dict(read_rows(E2E)[1], framework=framework, recompute="selective")
    model, plan, cluster, used = row_to_specs(row, {})
    assert (plan.recompute, plan.recompute_fraction) == expected
    said = [u for u in used if u.startswith("selective recompute as")]
    assert said == (["selective recompute as full on 0.5 of the layers"] if expected[1] < 1 else [])


@pytest.mark.parametrize(
    "framework, kernel, one_program",
    [
        ("JAX (XLA; optax AdamW)", "cudnn", True),
        ("Alpa (JAX)", "unfused", False),
        ("MyTrainer", "flash", False),
    ],
)
def test_attention_kernel_and_dispatch_are_the_frameworks(framework, kernel, one_program):
    """A JAX run is priced with cuDNN's fused attention (what ``jax.nn.dot_product_attention``
    runs with ``implementation="cudnn"``) and as one compiled program per step (no host
    dispatch per op, said in the row's defaults); Alpa, whose cells also say JAX, keeps its
    own kernel, and a framework no default names takes the generic FlashAttention-2 and
    dispatches every op."""
    row = dict(read_rows(E2E)[1], framework=framework)
    model, plan, _, used = row_to_specs(row, {})
    assert model.attention == kernel and plan.cuda_graphs == one_program
    assert any(u.startswith("cuda_graphs") for u in used) == one_program


def test_blank_time_is_a_skip_with_its_reason(capsys):
    out = validate(E2E)
    assert out["rows"][5]["skipped"] == "measured_iter_s blank"
    s = out["summary"]
    assert (s["rows"], s["predicted"], s["skipped"]) == (6, 3, 3)
    assert sum(r["skipped"] is not None for r in out["rows"]) == s["skipped"]
    # the per-row table lists measured rows only (a blank time used to fail to format)
    assert cli.main(["validate", str(E2E), "--rows"]) == 0
    assert "measured_iter_s blank" in capsys.readouterr().out


@pytest.mark.parametrize(
    "column, value, why",
    [
        ("measured_iter_s", "fast", "not a number: 'fast'"),
        ("measured_iter_s", "nan", "not a finite number: 'nan'"),
        ("measured_iter_s", "inf", "not a finite number: 'inf'"),
        ("tp", "2.5", "not an integer: '2.5'"),
        ("global_batch", "lots", "not a number: 'lots'"),
    ],
)
def test_bad_numbers_name_file_line_and_column(tmp_path, column, value, why):
    path = _write(tmp_path / "runs.csv", _set(column, 2, value))
    with pytest.raises(ValueError) as e:
        validate(path)
    assert str(e.value) == f"{path}: line 3: column '{column}': {why}"


def test_files_without_data_rows(tmp_path, capsys):
    header_only = _write(tmp_path / "header.csv", lambda h, rows: rows.clear())
    with pytest.raises(ValueError) as e:
        validate(header_only)
    assert str(e.value) == f"{header_only}: no data rows (only a header)"
    assert cli.main(["validate", str(header_only)]) == 2
    assert "diffcost validate: error: " in capsys.readouterr().err
    blank_rows = _write(
        tmp_path / "blank.csv", lambda h, rows: rows.__setitem__(slice(None), [[""] * len(h)] * 2)
    )
    with pytest.raises(ValueError, match="no data rows"):
        validate(blank_rows)
    for content in ("", " \n\n"):
        empty = tmp_path / "empty.csv"
        empty.write_text(content)
        with pytest.raises(ValueError, match=f"^{empty}: the file is empty"):
            validate(empty)


def test_missing_columns_are_a_file_error(tmp_path, capsys):
    """A column the rows need is an error for the whole file, every missing one named; a
    column of defaults (kv_heads, vocab, dp, ...) may be absent."""

    def drop(*columns):
        def edit(header, rows):
            for i in sorted((header.index(c) for c in columns), reverse=True):
                for row in [header, *rows]:
                    del row[i]

        return edit

    path = _write(tmp_path / "nohidden.csv", drop("hidden"))
    with pytest.raises(ValueError) as e:
        validate(path)
    assert str(e.value) == f"{path}: line 1: missing columns ['hidden']"
    assert cli.main(["validate", str(path)]) == 2
    assert "missing columns ['hidden']" in capsys.readouterr().err
    several = _write(tmp_path / "several.csv", drop("seq_len", "n_layers", "microbatch"))
    with pytest.raises(
        ValueError, match=r"missing columns \['n_layers', 'seq_len', 'microbatch'\]"
    ):
        read_rows(several)
    assert {"n_layers", "hidden", "heads", "seq_len", "n_gpus", "tp", "pp"} <= set(E2E_COLUMNS)
    optional = _write(tmp_path / "optional.csv", drop("kv_heads", "vocab", "dp", "cp", "ep"))
    assert len(read_rows(optional)) == 6


def test_rows_are_read_with_their_lines(tmp_path):
    ragged = _write(tmp_path / "ragged.csv", lambda h, rows: rows[1].append("extra"))
    with pytest.raises(ValueError) as e:
        read_rows(ragged)
    n = len(read_rows(E2E)[0])
    assert str(e.value) == f"{ragged}: line 3: {n + 1} cells, the header has {n}"
    # a byte-order mark (spreadsheet exports) and padded cells are read as the plain file
    bom = tmp_path / "bom.csv"
    bom.write_text(E2E.read_text().replace(",24,", ", 24 ,", 1), encoding="utf-8-sig")
    assert read_rows(bom) == read_rows(E2E)


def test_a_profile_of_another_gpu_skips_that_gpus_rows(tmp_path):
    """``--profile FILE`` fitted on A100s predicts the A100 rows with it; rows on H100
    clusters are skipped with the reason, not predicted with another GPU's constants."""
    from diffcost import profiles as prof

    fitted = prof.write_profile(
        tmp_path / "a100.yaml", {"nic_eff": 0.5}, {"layer": "cluster+device", "key": "vtrain-a100"}
    )
    out = validate(E2E, profile=fitted)
    by_cluster = {r["cluster"]: r for r in out["rows"][:3]}  # one row per cluster
    assert by_cluster["vtrain-a100"]["predicted_iter_s"] is not None
    for name in ("mosaic-h100", "dgx-h100"):
        assert by_cluster[name]["predicted_iter_s"] is None
        assert by_cluster[name]["skipped"].startswith(
            f"not predicted: {fitted} was fitted on vtrain-a100 (a100 GPUs) but {name} has"
        )
    # keyed by cluster and, where the row names its framework, its software stack
    assert set(out["profiles"]) == {"vtrain-a100 / megatron-deepspeed"}
