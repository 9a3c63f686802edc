"""Sweeps: sharding and padding change nothing, agreement with simulate_jit, Pareto front,
CSV and PNG files, the command line (table, JSON, nothing fits)."""

import argparse
import csv
import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffcost import api, default_params, space, sweep
from diffcost.arrays import GiB, cluster_arrays, model_arrays, plan_arrays
from diffcost.cli import sweep as sweep_cli
from diffcost.config import ConfigError
from diffcost.simulate import STATUS_NAMES, STATUS_OK, Breakdown, time_part
from diffcost.space import Choice

ROOT = Path(__file__).resolve().parent.parent
# every in-process sweep uses this chunk: one compilation serves the whole file (not a power
# of two, so no search test's evaluation bucket has compiled it before this file runs)
CHUNK = 96
SMALL = ("llama3-8b", "dgx-h100", 8, 32)  # 4,092 configurations
NOTHING_FITS = ("llama3-70b", "dgx-h100", 1, 8)  # 96 configurations, none fits in 80 GiB
# XLA:CPU compiles a program partitioned over several devices, a batch of another size and
# the unbatched simulate_jit differently (divisions by a replicated scalar turned into
# multiplications by its reciprocal, FMA contraction, YNNPACK reductions above ~32 KiB in
# another order): the same plan can differ in its last bits between those programs.
ULP_RTOL = 1e-12
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

_SHARDED_SCRIPT = """
import sys
import jax
import numpy as np

n_devices, chunk, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if len(sys.argv) > 4:  # one of several processes: coordinator address, process count, id
    address, n_processes, process_id = sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, n_processes, process_id)
    assert jax.process_count() == n_processes
from diffcost import default_params, space, sweep

assert len(jax.devices()) == n_devices, jax.devices()
assert jax.config.jax_enable_x64
s = space.load_space("llama3-8b", "dgx-h100", 8, 32)
plans, choices = space.enumerate_plans(s)
assert len(choices) % chunk, "the last chunk must be padded"
assert len(choices) > 3 * chunk, "several chunks"
b = sweep.evaluate(s, plans, default_params(), chunk=chunk)
np.savez(out, **vars(b))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_sweep(local_devices: int, chunk: int, out: Path, *cluster) -> subprocess.Popen:
    """A sweep in a fresh interpreter with ``local_devices`` CPU devices (``cluster``: the
    coordinator address, process count and process id of one process among several)."""
    env = dict(os.environ)
    devices = f"--xla_force_host_platform_device_count={local_devices}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {devices}".strip()  # conftest's kept
    env["JAX_ENABLE_X64"] = "1"
    env["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    n_devices = local_devices * (int(cluster[1]) if cluster else 1)
    argv = [sys.executable, "-c", _SHARDED_SCRIPT, str(n_devices), str(chunk), str(out)]
    argv += [str(a) for a in cluster]
    with open(out.with_suffix(".log"), "w") as log:  # a file: a full pipe would block it
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, out: Path) -> None:
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out.with_suffix(".log").read_text()


SHARDED_RUNS = ("d4", "p0", "p1")


@pytest.fixture(scope="module", autouse=True)
def sharded_runs(request, tmp_path_factory):
    """The subprocess sweeps of ``test_sharded_equals_unsharded``, started with the module.

    Each compiles ``simulate`` for about 10 s of CPU; started first, they compile while the
    in-process tests run, and the test (last in the file) collects them. Nothing starts when
    that test is not selected.
    """
    if not any(item.name == "test_sharded_equals_unsharded" for item in request.session.items):
        yield None
        return
    folder = tmp_path_factory.mktemp("sharded")
    address = f"127.0.0.1:{_free_port()}"
    procs = {
        "d4": _start_sweep(4, 1000, folder / "d4.npz"),
        "p0": _start_sweep(2, 1000, folder / "p0.npz", address, 2, 0),
        "p1": _start_sweep(2, 1000, folder / "p1.npz", address, 2, 1),
    }
    yield folder, procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def small():
    s = space.load_space(*SMALL)
    return sweep.sweep(s, default_params(), chunk=CHUNK)


def test_evaluate_agrees_with_simulate_jit(small):
    s, params = small.space, default_params()
    model, cluster = model_arrays(s.model), cluster_arrays(s.cluster)
    rows = np.linspace(0, len(small.choices) - 1, 6).astype(int)
    for i in rows:
        plan = plan_arrays(s.plan_spec(small.choices[i]))
        one = api.simulate_jit(model, plan, cluster, params)
        assert int(one.status) == small.breakdown.status[i]
        for key, leaf in vars(one).items():
            got = getattr(small.breakdown, key)[i]
            scale = 0.0  # zero-crossing time parts (bubble) are compared to the iteration
            scale = one.iteration_s if key.endswith("_s") else scale
            scale = one.memory_peak_bytes if key.endswith("_bytes") else scale
            np.testing.assert_allclose(
                got, np.asarray(leaf), rtol=ULP_RTOL, atol=ULP_RTOL * scale, err_msg=key
            )


def test_padding_and_position_change_nothing(small):
    plans, _ = space.enumerate_plans(small.space)
    start, n = 5, 100  # two chunks of 96, the second padded, rows shifted by 5
    part = jax.tree_util.tree_map(lambda x: x[start : start + n], plans)
    b = sweep.evaluate(small.space, part, default_params(), chunk=CHUNK)
    for key, leaf in vars(b).items():
        assert leaf.shape[0] == n
        assert np.array_equal(leaf, getattr(small.breakdown, key)[start : start + n]), key


def test_compiled_once_and_progress_reported(small):
    compilations = []

    def listener(event, duration_s, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compilations.append(duration_s)

    calls = []
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda x: x + 1.0)(np.ones(2))  # the listener sees compilations
        result = sweep.sweep(
            small.space, default_params(), chunk=CHUNK, progress=lambda *a: calls.append(a)
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compilations) == 1  # the program of the `small` sweep served this one
    assert result.compile_s < small.compile_s
    n = len(small.choices)
    assert calls[0] == (0, n) and calls[-1] == (n, n) and len(calls) == 1 + -(-n // CHUNK)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert result.devices == len(jax.devices()) and result.configs_per_s > 0


def test_chunk_size():
    assert sweep.chunk_size(10_000, 8192, 1) == 8192
    assert sweep.chunk_size(10_000, 1000, 3) == 1002  # a multiple of the device count
    assert sweep.chunk_size(96, 8192, 1) == 128  # a small space computes little padding
    with pytest.raises(ConfigError, match="chunk"):
        sweep.chunk_size(10, 0, 1)


def test_best_is_the_fastest_feasible(small):
    b = small.breakdown
    top = sweep.best(small, 10)
    assert len(top) == 10
    assert np.all(b.status[top] == STATUS_OK)
    assert np.all(np.diff(b.iteration_s[top]) >= 0)
    assert b.iteration_s[top[0]] == np.min(b.iteration_s[b.status == STATUS_OK])


def test_pareto_front_hand_made():
    t = [5.0, 1.0, 3.0, 3.0, 2.0, 0.5, 4.0, 3.0, np.nan]
    m = [1.0, 9.0, 2.0, 2.0, 5.0, 1.0, 1.0, 4.0, 0.1]
    ok = [True, True, True, True, True, False, True, True, True]
    # 5 is infeasible, 8 not finite; 3 repeats 2; 0 is dominated by 6; 7 by 2
    assert sweep.pareto_front(t, m, ok).tolist() == [6, 2, 4, 1]
    assert sweep.pareto_front(t, m, [False] * len(t)).tolist() == []


def _dominates(a_t, a_m, b_t, b_m):
    return (a_t <= b_t) & (a_m <= b_m) & ((a_t < b_t) | (a_m < b_m))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 8), st.booleans()), min_size=0, max_size=40
    )
)
def test_pareto_front_property(points):
    t = np.array([p[0] for p in points], dtype=float)
    m = np.array([p[1] for p in points], dtype=float)
    ok = np.array([p[2] for p in points], dtype=bool)
    front = sweep.pareto_front(t, m, ok)
    feasible = np.flatnonzero(ok)
    assert set(front) <= set(feasible)
    assert np.all(np.diff(m[front]) > 0) and np.all(np.diff(t[front]) < 0)
    for i in front:  # nothing feasible dominates a front point
        assert not np.any(_dominates(t[feasible], m[feasible], t[i], m[i]))
    for j in set(feasible) - set(front):  # every other feasible point is dominated or equal
        covered = (t[front] <= t[j]) & (m[front] <= m[j])
        assert np.any(covered)


def test_choice_label():
    s = space.load_space("gpt3-175b", "selene-a100-80g", 1024, 1536)
    c = Choice(8, 1, 16, 8, 1, 1, "1f1b", 1, "selective", 1, 0)  # tp, cp, dp, pp first
    assert c.label(s) == "tp8 pp8 dp16 mb1 1f1b zero1 sel"
    c = c._replace(cp=2, dp=8, schedule="interleaved", chunks=4, recompute="full", order=1)
    assert c.label(s) == "tp8 pp8 dp8 cp2 mb1 interleaved-v4 zero1 full order tp-cp-pp-dp"


def test_csv_rows_header_and_status(small, tmp_path):
    path = sweep_cli.write_csv(tmp_path / "sweep.csv", small)
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert reader.fieldnames == sweep.csv_header()
    # the choice's fields first, then the results, every time part among them
    assert reader.fieldnames[: len(Choice._fields)] == list(Choice._fields)
    assert set(Breakdown.TIME_PARTS) | {"iteration_s", "status", "pareto"} <= set(rows[0])
    assert len(rows) == len(small.choices) == len(small.space.choices())
    assert {r["status"] for r in rows} <= set(STATUS_NAMES)
    assert {r["order"] for r in rows} == {"tp-cp-dp-pp", "tp-cp-pp-dp"}
    assert sum(int(r["pareto"]) for r in rows) == len(sweep.result_front(small))
    first, b = rows[0], small.breakdown
    assert int(first["tp"]) == small.choices[0].tp
    assert float(first["iteration_s"]) == pytest.approx(b.iteration_s[0], rel=1e-5)
    assert float(first["memory_peak_gib"]) == pytest.approx(b.memory_peak_bytes[0] / GiB, rel=1e-5)
    assert first["status"] == STATUS_NAMES[b.status[0]]


def test_plot_is_a_png(small, tmp_path):
    path = sweep_cli.plot_pareto(tmp_path / "front.png", small)
    assert path.read_bytes()[:8] == PNG_MAGIC


def _run_cli(argv):
    parser = argparse.ArgumentParser()
    sweep_cli.add_arguments(parser)
    return sweep_cli.run(parser.parse_args(argv))


def test_cli_json_writes_files(capsys, tmp_path):
    out = tmp_path / "results.csv"
    argv = [SMALL[0], "--cluster", SMALL[1], "--gpus", str(SMALL[2])]
    argv += ["--global-batch", str(SMALL[3]), "--chunk", str(CHUNK), "--top", "3"]
    assert _run_cli([*argv, "--out", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["space_size"] == 4092 and d["n_gpus"] == 8 and d["global_batch"] == 32
    assert sum(d["status_counts"].values()) == d["space_size"] and d["fits"]
    assert len(d["top"]) == 3
    times = [row["iteration_s"] for row in d["top"]]
    assert times == sorted(times)
    assert set(d["top"][0]["plan"]) == set(Choice._fields)
    assert d["pareto_size"] >= 1 and d["configs_per_s"] > 0 and d["devices"] >= 1
    assert d["csv"] == str(out) and Path(d["csv"]).exists()
    assert d["plot"] == str(tmp_path / "results_pareto.png")
    assert Path(d["plot"]).read_bytes()[:8] == PNG_MAGIC


def test_cli_table(capsys):
    argv = [SMALL[0], "--cluster", SMALL[1], "--gpus", str(SMALL[2])]
    argv += ["--global-batch", str(SMALL[3]), "--chunk", str(CHUNK), "--profile", "none"]
    assert _run_cli(argv) == 0
    out = capsys.readouterr().out
    assert "constants: datasheet defaults" in out
    for word in ("fastest plans that fit", "iteration s", "MFU", "configurations/s", "Pareto"):
        assert word in out
    assert "4,092 configurations" in out


def test_cli_nothing_fits(capsys):
    argv = [NOTHING_FITS[0], "--cluster", NOTHING_FITS[1], "--gpus", str(NOTHING_FITS[2])]
    argv += ["--global-batch", str(NOTHING_FITS[3]), "--chunk", str(CHUNK)]
    assert _run_cli(argv) == 1  # as search: exit code 1 when no plan fits
    out = capsys.readouterr().out
    assert "Nothing fits" in out and "smallest peak is" in out and "GiB" in out
    assert _run_cli([*argv, "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert not d["fits"] and d["top"] == [] and d["status_counts"]["ok"] == 0
    low = d["smallest_memory"]
    assert low["memory_peak_gib"] > d["memory_capacity_gib"]
    assert f"{low['memory_peak_gib']:.1f} GiB" in out


def test_cli_bad_input_raises_config_error():
    with pytest.raises(ConfigError, match="gpus=3"):
        _run_cli("llama3-8b --cluster dgx-h100 --gpus 3 --global-batch 8".split())
    with pytest.raises(ConfigError, match="chunk"):
        _run_cli("llama3-8b --cluster dgx-h100 --gpus 8 --global-batch 8 --chunk 0".split())


def test_sharded_equals_unsharded(sharded_runs, small):
    """One process with 4 devices and two processes with 2 devices each (``jax.distributed``),
    5 chunks of 1,000 of the 4,092 plans, the last one padded; against this process's sweep
    on one device in chunks of 96 (``small``: float64 and strict promotion, as in the
    subprocesses; one device unless XLA_FLAGS forces more)."""
    folder, procs = sharded_runs
    for name, proc in procs.items():
        _finish(proc, folder / f"{name}.npz")
    d4, p0, p1 = (np.load(folder / f"{name}.npz") for name in SHARDED_RUNS)
    d1 = small.breakdown
    assert set(d4.files) == {f.name for f in dataclasses.fields(Breakdown)}
    for key in d4.files:
        # the same 4-way partitioned program, in one process or two: bitwise equal, and every
        # process holds every row
        assert np.array_equal(d4[key], p0[key]) and np.array_equal(p0[key], p1[key]), key
        # one device compiles differently (see ULP_RTOL): equal statuses, equal to ~1 ulp
        one = getattr(d1, key)
        assert d4[key].shape == one.shape and d4[key].dtype == one.dtype, key
        if key == "status":
            assert np.array_equal(d4[key], one)
        else:
            scale = np.max(np.abs(one))
            np.testing.assert_allclose(d4[key], one, rtol=ULP_RTOL, atol=ULP_RTOL * scale)
    # what a user reads off a sweep is the same: statuses, the fastest plans, the Pareto front
    # and every value as written to the CSV (6 significant digits)
    ok4, ok1 = d4["status"] == STATUS_OK, d1.status == STATUS_OK
    assert np.array_equal(
        sweep.pareto_front(d4["iteration_s"], d4["memory_peak_bytes"], ok4),
        sweep.pareto_front(d1.iteration_s, d1.memory_peak_bytes, ok1),
    )
    fastest4 = np.flatnonzero(ok4)[np.argsort(d4["iteration_s"][ok4], kind="stable")][:10]
    fastest1 = np.flatnonzero(ok1)[np.argsort(d1.iteration_s[ok1], kind="stable")][:10]
    assert np.array_equal(d4["iteration_s"][fastest4], d4["iteration_s"][fastest1])
    for key in ("iteration_s", "memory_peak_bytes", "tokens_per_s", "mfu"):
        assert sweep._fmt(d4[key]) == sweep._fmt(getattr(d1, key)), key
    b4 = Breakdown(**{k: d4[k] for k in d4.files})
    for key in Breakdown.TIME_PARTS:
        assert sweep._fmt(time_part(b4, key)) == sweep._fmt(time_part(d1, key)), key


def test_batch_axes_pass_constant_leaves_once():
    plans, _ = space.enumerate_plans(space.load_space(*SMALL))
    axes, split = sweep.batch_axes(plans)
    for name, axis, leaf in zip(
        [f.name for f in dataclasses.fields(plans) if f.metadata.get("pytree_node", True)],
        jax.tree_util.tree_leaves(axes, is_leaf=lambda a: a is None),
        jax.tree_util.tree_leaves(split),
    ):
        whole = np.asarray(getattr(plans, name))
        if axis is None:
            assert (whole == whole[:1]).all() and np.array_equal(leaf, whole[0]), name
        else:
            assert axis == 0 and np.array_equal(leaf, whole) and not (whole == whole[:1]).all()
    assert plans.lora.shape[0] > 1 and axes.lora is None and axes.tp == 0
    # one configuration: every leaf batched (vmap needs one)
    one = jax.tree_util.tree_map(lambda x: x[:1], plans)
    axes1, split1 = sweep.batch_axes(one)
    assert set(jax.tree_util.tree_leaves(axes1)) == {0}
    assert all(x.shape[0] == 1 for x in jax.tree_util.tree_leaves(split1))


def test_lora_space_swept_with_its_adapters():
    """A LoRA space's constant adapter leaves go unbatched (their ``lax.cond`` a branch); each
    plan gets what ``simulate_jit`` gives it, and the adapters cost time."""
    small = space.load_space(*SMALL)
    s = space.make_space(small.model, small.cluster, 8, 32, lora_rank=16)
    plans, choices = space.enumerate_plans(s)
    take = np.linspace(0, len(choices) - 1, 5).astype(int)
    part = jax.tree_util.tree_map(lambda x: x[take], plans)
    assert sweep.batch_axes(part)[0].lora_rank is None
    b = sweep.evaluate(s, part, default_params(), chunk=CHUNK)
    model, cluster = model_arrays(s.model), cluster_arrays(s.cluster)
    for row, i in enumerate(take):
        spec = s.plan_spec(choices[i])
        plan = plan_arrays(spec)
        one = api.simulate_jit(model, plan, cluster, default_params())
        np.testing.assert_allclose(b.iteration_s[row], one.iteration_s, rtol=ULP_RTOL)
        plain = plan_arrays(dataclasses.replace(spec, lora_rank=None))
        assert (
            one.iteration_s != api.simulate_jit(model, plain, cluster, default_params()).iteration_s
        )


def test_a_cluster_without_a_profile_is_swept_as_predict_times_it(capsys):
    """selene-a100-80g has no profile of its own: ``predict`` takes the median over the
    population's members, and the sweep times every plan the same way."""
    from diffcost import profiles
    from diffcost.specs import Experiment

    s = space.load_space("llama3-8b", "selene-a100-80g", 8, 32)
    members = profiles.population_members(s.cluster)
    assert len(members) > 1
    result = sweep.sweep_members(s, members, chunk=CHUNK)
    assert len(result.choices) == result.breakdown.iteration_s.shape[0]
    for i in sweep.best(result, 2):
        exp = Experiment(model=s.model, plan=s.plan_spec(result.choices[i]), cluster=s.cluster)
        predicted = api.predict(exp)
        assert float(predicted.iteration_s) == pytest.approx(result.breakdown.iteration_s[i], 1e-5)
        mem = float(predicted.memory_peak_bytes)
        assert mem == pytest.approx(float(result.breakdown.memory_peak_bytes[i]), rel=1e-6)
    argv = ["llama3-8b", "--cluster", "selene-a100-80g", "--gpus", "8", "--global-batch", "32"]
    assert _run_cli([*argv, "--chunk", str(CHUNK), "--top", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "median over the population's" in d["profile"]
    best = sweep.best(result, 1)[0]
    assert d["top"][0]["iteration_s"] == pytest.approx(float(result.breakdown.iteration_s[best]))
