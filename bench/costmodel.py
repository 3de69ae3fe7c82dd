"""A cost model of sparkcnn's exchanges, fitted on one setup and validated on another.

One exchange of one block: H local steps of ``t`` seconds each, then its delta
goes up and the model change comes back. Per exchange (N blocks, batch b, P
parameters, driver link of B bytes/s, C cores shared by everything, or
``cores=None``: a core per executor and one for the driver)::

    up, nnz_up  = (4P, P)                          dense uplink
                = (k·d_up·P_big + 2·P_small, …)    sparse: k bytes per entry, small tensors whole (float16)
    down        = 4P, or k·d_down·P_big + 2·P_small
    bytes       = up + down
    sel         = σ·P per sparse direction          threshold selection (uplink: worker, downlink: driver)
    a_driver    = c_stream + α_p + α_e·nnz_up + β_x·bytes/2 + sel_down·δ   the driver's own work on the
                                                 exchange; δ = downlinks per exchange: 1 async, 1/N sync
    o_driver    = a_driver + (Jcpu + Bcpu) / tasks + Jb·bytes   + the Spark job's CPU, jobs only
                                                 (tasks: N sync, 1 async; a broadcast per version)
    o_worker    = c_jobs + β_x·bytes/2 + sel_up     worker CPU beyond training
    o           = o_driver + o_worker           (x = jobs | stream: c_jobs per task in its Python worker,
                                                 0 on the stream; c_stream per message pair, 0 for jobs;
                                                 β_x per byte encoded, copied and decoded)
    T_cpu  = max(H·t, (N·H·t_c + φ·N·o) / C)     cores shared: φ of that CPU comes out of training
           = H·t + o_worker                      dedicated cores
    T_drv  = N·o_driver                           the driver serves every block's exchange in turn
    T_link = N·bytes / B
    T_lat  = H·t + max(o_worker, Jwall(N) + Bwall) + N·(bytes/B + Jw·bytes + a_driver)   jobs, sync:
                                                       a job per round, workers wait
           = H·t + max(o_worker, Jwall(1) + Bwall) + bytes/B + Jw·bytes + a_driver   jobs, async: a
                                                       job per exchange
           = H·t                                        stream: the exchange overlaps the next steps
    T      = max(T_cpu, T_drv, T_link, T_lat)             seconds per exchange of every block
    images/s = N·H·b / T,   speed-up = images/s / (b / t)  (one worker alone, no exchange)

Every bound is a lower bound on T. An empty job's wall already holds an empty task's run in
its Python worker, the fixed part of o_worker, so the two overlap: T_lat takes the larger,
not their sum (with the sum, a local[2] jobs round at H = 1 came out at 348 ms against the
185 ms measured, a round bound by the CPU).

The job's wall already holds its JVM's CPU, so the latency bound adds only the driver's
own work (a_driver), never Jcpu.

Measured per setup, inputs like the bandwidth (bench/_costmeasure.py): B (loopback), t and
t_c (one step's wall and its worker's CPU, both blocks training at once in the setup's warm
Spark Python workers, no exchange, full batches), Jwall(n) and Jcpu(n), the wall of an
empty Spark job of n tasks and the CPU of the driver and the JVMs for it, after 30 warm-up
jobs, as bench/jobcost.py (measured at 1 and 2, linear beyond), Jw and Jb, the wall and
that CPU a byte of a task's result adds (jobs returning a dense delta each), Bwall and Bcpu,
what a new broadcast of the dense model in a job's closure adds to it (the jobs transport
makes one per version: executors fetch it even when their tasks never read it), k and the
cores C. They hold what is a property of the setup: separate executor JVMs, RPC.

Fitted (:class:`Constants`), the costs that carry from one setup to another: α_p, α_e (the
driver's apply per payload and per entry) and σ (selection per parameter) from the
training setup's micro-measurements; c_jobs, β_jobs, c_stream, β_stream from its measured
CPU per exchange beyond H·t_c and the known terms (Spark's own Jcpu and Jb among them):
non-negative least squares against the bytes, per transport, each case weighted 1/H (what
is left beyond H·t_c carries H steps' noise); φ from its images/s (one-dimensional least squares on the log).

    python bench/costmodel.py [--quick]                       measure both setups, fit each way
    python bench/costmodel.py measure --setup local|cluster [--quick]
    python bench/costmodel.py fit --train A.json --test B.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, emit, exit_status, log  # noqa: E402

TRANSPORTS, MODES = ("jobs", "stream"), ("sync", "async")


@dataclass(frozen=True)
class Exchange:
    """One configuration to predict; sizes in parameters, times in seconds, bandwidth in bytes/s."""

    n: int                         # blocks (executor slots)
    bandwidth: float               # bytes/s of the driver's link; math.inf: free
    params: int                    # P
    t_step: float                  # one local step of one block alone (s)
    steps: int                     # H, local steps per exchange
    density_up: float | None       # None: dense uplink
    density_down: float | None     # None: dense downlink
    transport: str                 # jobs | stream
    mode: str                      # sync | async
    batch: int = 64                # images per step
    cores: int | None = None       # cores shared by workers, driver and JVMs; None: dedicated
    small_params: int = 0          # parameters in tensors sent whole (float16, no index)
    bytes_per_nonzero: float = 3.5  # codec, sparse entries (scale.py: 3.0 at 0.01, 3.5 at 0.001)
    job_wall_s: float = 0.0        # Jwall: an empty Spark job of this exchange's tasks, measured (s)
    job_cpu_s: float = 0.0         # Jcpu: driver and JVM CPU for that job, measured (s)
    job_byte_wall_s: float = 0.0   # Jw: the wall a byte of a task's result adds to its job (s/byte)
    job_byte_cpu_s: float = 0.0    # Jb: the driver and JVM CPU it adds (s/byte)
    job_bcast_wall_s: float = 0.0  # Bwall: the wall a broadcast of the model adds to its job (s)
    job_bcast_cpu_s: float = 0.0   # Bcpu: the driver and JVM CPU it adds (s)
    t_cpu: float | None = None     # t_c: the CPU of one step (s); None: t_step

    def __post_init__(self):
        if self.n < 1 or self.steps < 1 or self.params < 1 or self.t_step <= 0 or self.bandwidth <= 0:
            raise ValueError(f"Exchange: n, steps, params, t_step and bandwidth must be > 0, got {self}")
        if min(self.job_wall_s, self.job_cpu_s, self.job_byte_wall_s, self.job_byte_cpu_s, self.job_bcast_wall_s,
               self.job_bcast_cpu_s) < 0:
            raise ValueError(f"Exchange.job_wall_s, job_cpu_s and their per-byte costs must be >= 0, got {self}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"Exchange.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.mode not in MODES:
            raise ValueError(f"Exchange.mode must be one of {MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class Constants:
    """The fitted constants, those that carry across setups (seconds, seconds per byte or per
    entry; ``share`` a fraction). A Spark job's wall and CPU are measured inputs of :class:`Exchange`."""

    apply_payload_s: float = 0.0   # α_p: driver's decode + guard + apply, per payload
    apply_entry_s: float = 0.0     # α_e: the same, per entry carried
    select_s: float = 0.0          # σ: threshold selection per parameter, per sparse direction
    cpu_stream_s: float = 0.0      # c_stream: CPU per Flight message pair, both ends
    cpu_jobs_s: float = 0.0        # c_jobs: a task's CPU in its Python worker beyond training (closure, state)
    byte_jobs_s: float = 0.0       # β_jobs: CPU per byte moved through a job's result
    byte_stream_s: float = 0.0     # β_stream: CPU per byte moved on the stream
    share: float = 1.0             # φ: share of the non-training CPU that comes out of training


def payload(params: int, density: float | None, small: int, k: float) -> tuple[float, float]:
    """(bytes, entries) of one payload: dense float32, or k bytes per sparse entry and float16 small tensors."""
    if density is None:
        return 4.0 * params, float(params)
    big = params - small
    return k * density * big + 2.0 * small, density * big + small


def job_cost(inputs: dict, tasks: int) -> tuple[float, float]:
    """(Jwall, Jcpu) of an empty job of ``tasks`` tasks from the setup's measured 1- and 2-task jobs
    (``inputs["job_wall_s"]``, ``["job_cpu_s"]``), linear in the tasks: J(1) + (J(2) − J(1))·(tasks − 1)."""
    def line(j: dict) -> float:
        return max(0.0, j["1"] + (j["2"] - j["1"]) * (tasks - 1))
    return line(inputs["job_wall_s"]), line(inputs["job_cpu_s"])


def moved_bytes(x: Exchange) -> float:
    """Bytes of one block's exchange, up and down."""
    up, _ = payload(x.params, x.density_up, x.small_params, x.bytes_per_nonzero)
    down, _ = payload(x.params, x.density_down, x.small_params, x.bytes_per_nonzero)
    return up + down


def job_share(x: Exchange) -> float:
    """(Jcpu + Bcpu) / tasks + Jb·bytes: one exchange's share of its Spark job's CPU (0 on the stream)."""
    if x.transport != "jobs":
        return 0.0
    return (x.job_cpu_s + x.job_bcast_cpu_s) / (x.n if x.mode == "sync" else 1) + x.job_byte_cpu_s * moved_bytes(x)


def downlinks_per_exchange(x: Exchange) -> float:
    """Downlinks the driver builds per exchange of one block: async, one per applied result;
    sync, one per round of N exchanges."""
    return 1.0 if x.mode == "async" else 1.0 / x.n


def exchange_cpu(x: Exchange, c: Constants) -> tuple[float, float]:
    """(o_driver, o_worker): CPU seconds per exchange of one block beyond its training."""
    up, nnz_up = payload(x.params, x.density_up, x.small_params, x.bytes_per_nonzero)
    down, _ = payload(x.params, x.density_down, x.small_params, x.bytes_per_nonzero)
    fixed, task, per_byte = ((0.0, c.cpu_jobs_s, c.byte_jobs_s) if x.transport == "jobs"
                             else (c.cpu_stream_s, 0.0, c.byte_stream_s))
    moved = per_byte * (up + down) / 2  # each byte encoded on one side, decoded on the other
    sel_up = c.select_s * x.params if x.density_up is not None else 0.0
    sel_down = c.select_s * x.params * downlinks_per_exchange(x) if x.density_down is not None else 0.0
    own = fixed + c.apply_payload_s + c.apply_entry_s * nnz_up + moved + sel_down
    return own + job_share(x), task + moved + sel_up


def exchange_time(x: Exchange, c: Constants) -> dict:
    """Seconds per exchange of every block (``T``) and each bound of the module docstring."""
    wire = moved_bytes(x) / x.bandwidth  # one block's bytes on the driver's link
    o_d, o_w = exchange_cpu(x, c)
    own = o_d - job_share(x)  # the job's wall already holds its CPU
    compute = x.steps * x.t_step
    if x.cores is None:
        cpu = compute + o_w
    else:
        t_cpu = x.t_step if x.t_cpu is None else x.t_cpu
        cpu = max(compute, (x.n * x.steps * t_cpu + c.share * x.n * (o_d + o_w)) / x.cores)
    result = x.job_byte_wall_s * moved_bytes(x)  # through Spark's task results and closures
    job = x.job_wall_s + x.job_bcast_wall_s
    if x.transport == "stream":
        lat = compute
    elif x.mode == "sync":
        lat = compute + max(o_w, job) + x.n * (wire + result + own)
    else:
        lat = compute + max(o_w, job) + wire + result + own
    bounds = {"cpu": cpu, "driver": x.n * o_d, "link": x.n * wire, "latency": lat}
    return {"T": max(bounds.values()), "bound": max(bounds, key=bounds.get), **bounds}


def images_per_s(x: Exchange, c: Constants) -> float:
    """N·H·b / T."""
    return x.n * x.steps * x.batch / exchange_time(x, c)["T"]


def speedup(x: Exchange, c: Constants) -> float:
    """images/s over one worker's alone with no exchange (b / t)."""
    return images_per_s(x, c) / (x.batch / x.t_step)


# -- fitting ----------------------------------------------------------------------------------

def measured_costs(inputs: dict) -> dict:
    """The :class:`Exchange` fields a setup's measurement gives beyond its Spark job of n tasks
    (absent from older records: the model's defaults)."""
    keys = ("job_byte_wall_s", "job_byte_cpu_s", "job_bcast_wall_s", "job_bcast_cpu_s")
    return {"t_cpu": inputs.get("t_cpu"), **{k: inputs.get(k, 0.0) for k in keys}}


def exchange_of(inputs: dict, case: dict, **over) -> Exchange:
    """The :class:`Exchange` of one measured grid point (sparse = uplink 0.001, downlink 0.01)
    with its setup's measured inputs."""
    wall, cpu = job_cost(inputs, inputs["n"] if case["mode"] == "sync" else 1)
    return Exchange(job_wall_s=wall, job_cpu_s=cpu, **measured_costs(inputs), n=inputs["n"],
                    bandwidth=inputs["bandwidth"], params=inputs["params"], t_step=inputs["t_step"],
                    steps=case["steps"], density_up=None if case["dense"] else 0.001,
                    density_down=None if case["dense"] else 0.01, transport=case["transport"], mode=case["mode"],
                    batch=inputs["batch"], cores=inputs["cores"], small_params=inputs["small_params"],
                    bytes_per_nonzero=inputs["bytes_per_nonzero"], **over)


def _nonneg_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Weighted least squares ``y ≈ a + b·x`` (weights ``w`` on the residuals) with a, b >= 0
    (a coefficient that would be negative is 0, the other refitted alone)."""
    x, y = w * x, w * y
    a, b = np.linalg.lstsq(np.stack([w, x], 1), y, rcond=None)[0]
    if b < 0:
        return max(0.0, float(w @ y / (w @ w))), 0.0
    if a < 0:
        return 0.0, max(0.0, float(x @ y / (x @ x)))
    return float(a), float(b)


def fit(meas: dict) -> Constants:
    """Constants from one setup's measurements (see the module docstring for which from what)."""
    micro, inputs, cases = meas["micro"], meas["inputs"], meas["cases"]
    rows = micro["apply"]
    a = np.array([[r["payloads"], r["entries"]] for r in rows], float)
    coef = np.linalg.lstsq(a, np.array([r["s"] for r in rows]), rcond=None)[0]
    c = Constants(apply_payload_s=max(0.0, float(coef[0])), apply_entry_s=max(0.0, float(coef[1])),
                  select_s=micro["select_s_per_param"])
    for tr in TRANSPORTS:
        xs, ys, ws = [], [], []
        for case in (v for v in cases.values() if v["transport"] == tr):
            x = exchange_of(inputs, case)
            known = sum(exchange_cpu(x, c))  # job share, apply and selection; c_x = β_x = 0 so far
            measured = sum(v for k, v in case["cpu_ms_per_exchange"].items() if k != "total") / 1000
            xs.append(moved_bytes(x))
            ws.append(1.0 / x.steps)
            t_cpu = x.t_step if x.t_cpu is None else x.t_cpu
            ys.append(measured - x.steps * t_cpu - known)  # the training's own CPU left out
        if not xs:
            continue
        fixed, per_byte = _nonneg_line(np.array(xs), np.array(ys), np.array(ws))
        if tr == "jobs":
            c = replace(c, cpu_jobs_s=fixed, byte_jobs_s=per_byte)
        else:
            c = replace(c, cpu_stream_s=fixed, byte_stream_s=per_byte)
    grid = np.arange(0.0, 2.0001, 0.005)
    loss = [sum((math.log(images_per_s(exchange_of(inputs, v), replace(c, share=float(phi))) / v["images_per_s"])) ** 2
                for v in cases.values()) for phi in grid]
    return replace(c, share=float(grid[int(np.argmin(loss))]))


def validate(meas: dict, c: Constants) -> list[dict]:
    """Predicted vs measured images/s at every grid point of ``meas`` (error = predicted / measured − 1)."""
    out = []
    for name, case in meas["cases"].items():
        x = exchange_of(meas["inputs"], case)
        p = images_per_s(x, c)
        out.append({"setup": meas["setup"], "case": name, "predicted": round(p, 1),
                    "measured": round(case["images_per_s"], 1), "error": round(p / case["images_per_s"] - 1, 4),
                    "bound": exchange_time(x, c)["bound"]})
    return out


def speedup_curve(c: Constants, inputs: dict) -> dict:
    """Predicted speed-up for N = 1 … 256 at 1 and 10 Gbit/s, dedicated cores, H = 1 and 10:
    dense / sparse (0.001 up, 0.01 down) x jobs (sync) / stream (async); ``inputs``: the setup
    whose step time and Spark jobs (extrapolated linearly in the tasks) it assumes."""
    params, t_step, small_params, k = (inputs[f] for f in ("params", "t_step", "small_params",
                                                           "bytes_per_nonzero"))
    ns = [2 ** i for i in range(9)]
    out = {"n": ns}
    for gbit in (1, 10):
        for h in (1, 10):
            for tr, mode in (("jobs", "sync"), ("stream", "async")):
                for kind, (du, dd) in (("dense", (None, None)), ("sparse", (0.001, 0.01))):
                    x = [Exchange(n=n, bandwidth=gbit * 1e9 / 8, params=params, t_step=t_step, steps=h,
                                  **measured_costs(inputs),
                                  density_up=du, density_down=dd, transport=tr, mode=mode,
                                  small_params=small_params, bytes_per_nonzero=k,
                                  **dict(zip(("job_wall_s", "job_cpu_s"), job_cost(inputs, n)))) for n in ns]
                    out[f"{gbit}gbit_h{h}_{tr}_{kind}"] = [round(speedup(e, c), 3) for e in x]
    return out


def fit_report(train: dict, test: dict) -> dict:
    c = fit(train)
    return {"direction": f"{train['setup']}->{test['setup']}", "constants": asdict(c),
            "fit": validate(train, c), "validation": validate(test, c)}


def _summary(reports: list[dict], measurements: list[dict]) -> dict:
    held_out = [row for r in reports for row in r["validation"]]
    worst = max(abs(r["error"]) for r in held_out)
    source = next((m for m in measurements if m["setup"] == "cluster"), measurements[-1])
    c, inputs = fit(source), source["inputs"]
    return {"bench": "costmodel", "constants": {r["direction"]: r["constants"] for r in reports},
            "validation": held_out, "max_abs_error": worst, "within_25pct": worst <= 0.25,
            "fit_residuals": {r["direction"]: r["fit"] for r in reports},
            "speedup_curve": {"constants_from": source["setup"],
                              **speedup_curve(c, inputs)},
            "measurements": measurements}


def _measure_child(setup: str, quick: bool) -> dict:
    """``measure`` in a child process (one SparkContext per process): its JSON record."""
    cmd = [sys.executable, os.path.abspath(__file__), "measure", "--setup", setup, *(["--quick"] if quick else [])]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"costmodel measure --setup {setup} failed with exit code {done.returncode}")
    return json.loads(done.stdout)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter grid, about 2 minutes per setup")
    sub = ap.add_subparsers(dest="cmd")
    m = sub.add_parser("measure", help="one setup's grid and micro-measurements")
    m.add_argument("--setup", choices=("local", "cluster"), required=True)
    m.add_argument("--quick", action="store_true")
    f = sub.add_parser("fit", help="fit on --train, predict --test")
    f.add_argument("--train", required=True)
    f.add_argument("--test", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "measure":
        from bench._costmeasure import measure

        out = measure(a.setup, a.quick)
    elif a.cmd == "fit":
        with open(a.train) as fh, open(a.test) as gh:
            train, test = json.load(fh), json.load(gh)
        out = _summary([fit_report(train, test)], [train, test])
    else:
        ms = [_measure_child(s, a.quick) for s in ("local", "cluster")]
        out = _summary([fit_report(ms[0], ms[1]), fit_report(ms[1], ms[0])], ms)
    emit(out)
    return out


if __name__ == "__main__":
    sys.exit(exit_status("costmodel", main()))
