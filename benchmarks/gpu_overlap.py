"""Measure, on one GPU, how a GEMM slows beside communication-like kernels and under load.

    python3 benchmarks/gpu_overlap.py --out DIR [--budget-s 80]

Two experiments on what separates a training step's compute rate (``Params.step_compute``) from
kernel tables measured alone:

* **SM sharing** (``overlap.csv``). NCCL runs each collective as a kernel of a few CTAs, one per
  channel, that stays resident while the collective lasts; an overlapped collective therefore
  holds SMs that the GEMMs beside it cannot use. On a second stream a kernel of ``ctas`` CTAs
  is started first and lasts longer than a batch of GEMMs on the first stream: ``spin`` CTAs
  hold their SMs and touch no memory, ``copy`` CTAs stream a buffer through HBM as a channel's
  copy loop does. Each row gives the GEMM batch's time per GEMM alone and beside the occupier,
  and the occupier's bandwidth (``copy``).
* **Sustained load** (``clocks.csv``). Back-to-back 8192^3 bf16 GEMMs for ``--sustain-s``
  seconds, timed per batch with CUDA events beside ``nvidia-smi`` readings of the SM clock and
  power: whether a training step's minutes of load run at a kernel table's seconds-long rate.
* **Cool against hot, per shape** (``cool.csv``, ``--only cool``). Each of ``COOL_SHAPES``
  after ``--idle-s`` seconds of idle GPU (a few untimed GEMMs first bring the clock up from
  idle): a short timed batch (``cool_tflops``, a burst as cool-GPU kernel tables time it), then
  ``--hot-s`` seconds back to back (``hot_tflops``: the median of the last five batches), and
  their ratio: whether one factor takes a cool table to a training step's rate at every shape.

Needs PyTorch and Triton (the device machine's image has both; nothing of diffcost is imported
and diffcost does not depend on either). ``summarize`` (pure Python) reads ``overlap.csv`` back
and is what the tests check.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

OVERLAP_COLUMNS = (
    "m,n,k,occupier,ctas,sms,gemm_s_alone,gemm_s_with,slowdown,occupier_GBps,overlapped"
).split(",")
CLOCK_COLUMNS = ("t_s,gemm_tflops,sm_mhz,power_w").split(",")
COOL_COLUMNS = ("m,n,k,idle_s,cool_tflops,hot_tflops,ratio").split(",")
COOL_SHAPES = (
    (8192, 2048, 2048),
    (4096, 4096, 4096),
    (16384, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 4096, 16384),
    (16384, 16384, 16384),
)
COOL_BATCH_S = 0.02
HOT_BATCH_S = 0.05
GEMM_SHAPES = ((8192, 8192, 8192), (16384, 4096, 4096), (16384, 4096, 16384), (4096, 4096, 4096))
CTAS = (8, 16, 32, 66)
OCCUPIERS = ("spin", "copy")
MIN_BATCH_S = 0.05
COPY_BYTES = 1 << 30
THREADS_WARPS = 16  # 512 threads per CTA, as an NCCL channel's kernel


def summarize(rows) -> dict:
    """Per occupier: ``{ctas: mean slowdown}`` and the slope of slowdown - 1 against the share
    of SMs held (least squares through the origin). ``rows`` are ``overlap.csv`` dicts; rows
    whose occupier ended before the GEMMs (``overlapped`` 0) are left out."""
    out = {}
    for kind in sorted({r["occupier"] for r in rows}):
        mine = [r for r in rows if r["occupier"] == kind and int(float(r["overlapped"])) == 1]
        if not mine:
            continue
        by_ctas = {}
        for r in mine:
            by_ctas.setdefault(int(r["ctas"]), []).append(float(r["slowdown"]))
        share = [int(r["ctas"]) / int(r["sms"]) for r in mine]
        extra = [float(r["slowdown"]) - 1.0 for r in mine]
        slope = sum(s * e for s, e in zip(share, extra)) / sum(s * s for s in share)
        out[kind] = {
            "slowdown": {c: statistics.fmean(v) for c, v in sorted(by_ctas.items())},
            "slope_per_sm_share": slope,
            "rows": len(mine),
        }
    return out


def _kernels():
    """The two occupier kernels (Triton, compiled on first use)."""
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out_ptr, n_iter, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = offs.to(tl.float32)
        for _ in range(n_iter):
            x = x * 0.999 + 1.0
        tl.store(out_ptr + tl.program_id(0) * BLOCK + offs, x)

    @triton.jit
    def copy(src, dst, n_blocks, reps, NPROG: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        for _ in range(reps):
            for b in range(tl.program_id(0), n_blocks, NPROG):
                o = b * BLOCK + offs
                tl.store(dst + o, tl.load(src + o))

    return spin, copy


class Bench:
    """CUDA state: streams, buffers, the occupier kernels and their calibrated speeds."""

    BLOCK = 1024

    def __init__(self, torch):
        self.torch = torch
        self.dev = torch.device("cuda")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.main, self.side = torch.cuda.Stream(), torch.cuda.Stream()
        self.spin, self.copy = _kernels()
        n = COPY_BYTES // 4
        self.src = torch.ones(n, dtype=torch.float32, device=self.dev)
        self.dst = torch.empty_like(self.src)
        self.sink = torch.empty(max(CTAS) * self.BLOCK, dtype=torch.float32, device=self.dev)
        self.n_blocks = n // self.BLOCK

    def events(self):
        return self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)

    def launch(self, kind, ctas, amount):
        """One occupier of ``ctas`` CTAs: ``amount`` spin iterations or copy passes."""
        if kind == "spin":
            self.spin[(ctas,)](self.sink, amount, BLOCK=self.BLOCK, num_warps=THREADS_WARPS)
        else:
            self.copy[(ctas,)](
                self.src,
                self.dst,
                self.n_blocks,
                amount,
                NPROG=ctas,
                BLOCK=self.BLOCK,
                num_warps=THREADS_WARPS,
            )

    def occupier_s(self, kind, ctas, amount):
        """Seconds one occupier takes alone."""
        self.launch(kind, ctas, amount)
        a, b = self.events()
        a.record()
        self.launch(kind, ctas, amount)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def amount_for(self, kind, ctas, seconds):
        """Iterations or passes for an occupier of about ``seconds``."""
        probe = 20000 if kind == "spin" else 1
        t = self.occupier_s(kind, ctas, probe)
        return max(1, int(probe * seconds / t)), t / probe


def _gemm_batch(torch, a, b, n):
    for _ in range(n):
        torch.matmul(a, b)


def _time_gemms(bench, a, b, n):
    """Seconds per GEMM over a batch of ``n`` on the current stream."""
    torch = bench.torch
    s, e = bench.events()
    s.record()
    _gemm_batch(torch, a, b, n)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3 / n


def overlap_rows(bench, deadline):
    """``overlap.csv`` rows: each GEMM shape alone and beside each occupier and CTA count."""
    torch = bench.torch
    for m, n, k in GEMM_SHAPES:
        if time.perf_counter() > deadline:
            return
        a = torch.randn(m, k, dtype=torch.bfloat16, device=bench.dev)
        b = torch.randn(k, n, dtype=torch.bfloat16, device=bench.dev)
        _gemm_batch(torch, a, b, 3)
        once = _time_gemms(bench, a, b, 3)
        count = max(4, int(MIN_BATCH_S / once))
        alone = statistics.median(_time_gemms(bench, a, b, count) for _ in range(3))
        for kind in OCCUPIERS:
            for ctas in CTAS:
                if time.perf_counter() > deadline:
                    return
                yield _with_occupier(bench, a, b, count, alone, kind, ctas, (m, n, k))


def _with_occupier(bench, a, b, count, alone, kind, ctas, shape):
    """One row: the GEMM batch timed while an occupier three times as long runs beside it."""
    torch = bench.torch
    amount, per_unit = bench.amount_for(kind, ctas, 3.0 * alone * count + 0.01)
    torch.cuda.synchronize()
    o_start, o_end = bench.events()
    # both streams are non-blocking pool streams: the GEMMs start while the occupier runs
    with torch.cuda.stream(bench.side):
        o_start.record()
        bench.launch(kind, ctas, amount)
        o_end.record()
    with_s = _time_gemms(bench, a, b, count)
    g_end = torch.cuda.Event(enable_timing=True)
    g_end.record()
    torch.cuda.synchronize()
    overlapped = o_start.elapsed_time(o_end) >= o_start.elapsed_time(g_end)
    gbps = 2.0 * COPY_BYTES / per_unit / 1e9 if kind == "copy" else 0.0
    return {
        **dict(zip("mnk", shape)),
        "occupier": kind,
        "ctas": ctas,
        "sms": bench.sms,
        "gemm_s_alone": f"{alone:.6e}",
        "gemm_s_with": f"{with_s:.6e}",
        "slowdown": f"{with_s / alone:.4f}",
        "occupier_GBps": f"{gbps:.1f}",
        "overlapped": int(overlapped),
    }


def cool_rows(bench, idle_s, hot_s):
    """``cool.csv`` rows: each of ``COOL_SHAPES`` as a burst after an idle GPU, then sustained."""
    torch = bench.torch
    for m, n, k in COOL_SHAPES:
        a = torch.randn(m, k, dtype=torch.bfloat16, device=bench.dev)
        b = torch.randn(k, n, dtype=torch.bfloat16, device=bench.dev)
        flops = 2.0 * m * n * k
        once = _time_gemms(bench, a, b, 3)
        torch.cuda.synchronize()
        time.sleep(idle_s)
        _gemm_batch(torch, a, b, 5)  # the clock rises from idle within these
        cool = _time_gemms(bench, a, b, max(3, int(COOL_BATCH_S / once)))
        count, t0, hot = max(3, int(HOT_BATCH_S / once)), time.perf_counter(), []
        while time.perf_counter() - t0 < hot_s or len(hot) < 5:
            hot.append(_time_gemms(bench, a, b, count))
        hot_s_per = statistics.median(hot[-5:])
        yield {
            **dict(zip("mnk", (m, n, k))),
            "idle_s": idle_s,
            "cool_tflops": f"{flops / cool / 1e12:.1f}",
            "hot_tflops": f"{flops / hot_s_per / 1e12:.1f}",
            "ratio": f"{cool / hot_s_per:.4f}",
        }
        del a, b


def _smi(path):
    query = "timestamp,clocks.sm,power.draw"
    cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "200"]
    try:
        return subprocess.Popen(cmd, stdout=open(path, "w"), stderr=subprocess.DEVNULL)
    except OSError:
        return None


def clock_rows(bench, seconds, smi_path):
    """``clocks.csv`` rows: TFLOP/s of back-to-back 8192^3 GEMM batches over ``seconds``, with
    the last ``nvidia-smi`` reading before each batch ended."""
    torch = bench.torch
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=bench.dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=bench.dev)
    flops = 2.0 * 8192**3
    proc = _smi(smi_path)
    time.sleep(0.5)
    t0 = time.perf_counter()
    batches = []
    while time.perf_counter() - t0 < seconds:
        per = _time_gemms(bench, a, b, 40)
        batches.append((time.perf_counter() - t0, flops / per / 1e12))
    if proc is not None:
        proc.terminate()
        proc.wait()
    readings = _read_smi(smi_path)
    rows = []
    for t, tflops in batches:
        mhz, watts = _reading_before(readings, t0, t)
        rows.append(
            {"t_s": f"{t:.3f}", "gemm_tflops": f"{tflops:.1f}", "sm_mhz": mhz, "power_w": watts}
        )
    return rows


def _read_smi(path):
    out = []
    if not os.path.exists(path):
        return out
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((stamp, parts[1], parts[2]))
        except ValueError:
            continue
    return out


def _reading_before(readings, t0, t):
    """The SM clock and power of the last reading at or before ``t`` seconds after ``t0``."""
    wall = time.time() - (time.perf_counter() - t0) + t
    before = [r for r in readings if r[0] <= wall]
    return (before[-1][1], before[-1][2]) if before else ("", "")


def write_csv(path, columns, rows) -> int:
    rows = list(rows)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    return len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the CSV files")
    p.add_argument("--budget-s", type=float, default=80.0, help="SM-sharing rows start before")
    p.add_argument("--sustain-s", type=float, default=25.0, help="seconds of sustained GEMMs")
    p.add_argument("--only", default="overlap,clocks", help="overlap, clocks, cool (any of)")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle seconds before a cool burst")
    p.add_argument("--hot-s", type=float, default=3.0, help="sustained seconds per cool shape")
    args = p.parse_args(argv)
    import torch

    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    bench = Bench(torch)
    counts = {}
    with torch.cuda.stream(bench.main):
        if "overlap" in args.only:
            overlap = list(overlap_rows(bench, start + args.budget_s))
            counts["overlap"] = write_csv(
                os.path.join(args.out, "overlap.csv"), OVERLAP_COLUMNS, overlap
            )
            print(json.dumps(summarize(overlap), indent=1))
        if "clocks" in args.only:
            clocks = clock_rows(bench, args.sustain_s, os.path.join(args.out, "smi.log"))
            counts["clocks"] = write_csv(
                os.path.join(args.out, "clocks.csv"), CLOCK_COLUMNS, clocks
            )
        if "cool" in args.only:
            rows = cool_rows(bench, args.idle_s, args.hot_s)
            counts["cool"] = write_csv(os.path.join(args.out, "cool.csv"), COOL_COLUMNS, rows)
    meta = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_kind": torch.cuda.get_device_name(0),
        "sms": bench.sms,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": counts,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    with open(os.path.join(args.out, "meta_overlap.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    print(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
