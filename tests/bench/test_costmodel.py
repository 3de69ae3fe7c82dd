"""bench/costmodel.py: the model's limits and the fit, on synthetic measurements (no Spark)."""

import math
import os
import sys
from dataclasses import asdict, replace

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.costmodel import (  # noqa: E402
    Constants,
    Exchange,
    exchange_cpu,
    exchange_of,
    exchange_time,
    fit,
    images_per_s,
    job_cost,
    payload,
    speedup,
    validate,
)

P, SMALL, T = 225_034, 1_802, 0.040  # fmnist_cnn's parameters, those in small tensors, one step (s)
C = Constants(apply_payload_s=2e-4, apply_entry_s=2e-8, select_s=5e-9, cpu_stream_s=0.004, byte_jobs_s=3e-8,
              byte_stream_s=5e-9, share=0.8)
# a setup's measured fixed costs: an empty Spark job of 1 and 2 tasks, wall and CPU (s)
LOCAL = {"t_step": T, "job_wall_s": {"1": 0.09, "2": 0.11}, "job_cpu_s": {"1": 0.05, "2": 0.07}}
CLUSTER = {"t_step": 1.2 * T, "job_wall_s": {"1": 0.25, "2": 0.31}, "job_cpu_s": {"1": 0.12, "2": 0.16}}


def ex(**kw) -> Exchange:
    base = dict(n=2, bandwidth=math.inf, params=P, t_step=T, steps=10, density_up=0.001, density_down=0.01,
                transport="stream", mode="async", small_params=SMALL)
    return Exchange(**{**base, **kw})


def test_infinite_bandwidth_is_compute_bound_less_the_cpu_share():
    for n in (2, 8):
        x = ex(n=n, cores=n)
        o = sum(exchange_cpu(x, C))
        limit = n * x.batch / T
        # shared cores: images/s = N·b/t · H·t / (H·t + φ·o)
        assert images_per_s(x, C) == pytest.approx(limit * 10 * T / (10 * T + C.share * o))
        assert images_per_s(x, replace(C, share=0.0)) == pytest.approx(limit)
        # dedicated cores, a driver with time to spare: only the worker's own CPU is lost
        d = ex(n=n)
        assert images_per_s(d, C) == pytest.approx(limit * 10 * T / (10 * T + exchange_cpu(d, C)[1]))
        assert exchange_time(d, replace(C, **{k: 0.0 for k in asdict(C)}))["T"] == pytest.approx(10 * T)


def test_sparse_beats_dense_only_when_bandwidth_bound():
    c = replace(C, byte_stream_s=0.0, byte_jobs_s=0.0, apply_entry_s=0.0)  # bytes cost link time only
    for tr, mode in (("stream", "async"), ("jobs", "sync")):
        dense = dict(density_up=None, density_down=None, transport=tr, mode=mode)
        fast, slow = dict(bandwidth=math.inf), dict(bandwidth=1e9 / 8)  # 1 Gbit/s
        # compute-bound: selecting costs CPU and saves nothing
        assert images_per_s(ex(**fast, **dense), c) >= images_per_s(ex(**fast, transport=tr, mode=mode), c)
        # 64 blocks of 1.8 MB per exchange on 1 Gbit/s: the link binds dense, not sparse
        t = exchange_time(ex(n=64, **slow, **dense), c)
        assert t["link"] > 2 * t["cpu"] and t["bound"] in ("link", "latency")  # jobs: the round waits for it
        assert images_per_s(ex(n=64, **slow, transport=tr, mode=mode), c) > 1.2 * images_per_s(
            ex(n=64, **slow, **dense), c)
        assert exchange_time(ex(n=64, **slow, transport=tr, mode=mode), c)["bound"] != "link"


def test_jobs_at_one_step_are_bounded_by_the_job():
    for n in (1, 2, 16):
        job, cpu = job_cost(LOCAL, n)
        x = ex(n=n, steps=1, transport="jobs", mode="sync", job_wall_s=job, job_cpu_s=cpu)
        assert images_per_s(x, C) <= n * x.batch / job
        assert images_per_s(x, C) < 0.5 * n * x.batch / T  # the job, not the step, sets the pace
        assert exchange_time(x, C)["bound"] == "latency"
        # the job's wall holds its CPU: the latency bound adds the driver's own work, not Jcpu again
        assert exchange_time(x, C)["latency"] == pytest.approx(exchange_time(replace(x, job_cpu_s=0.0), C)["latency"])
    job, cpu = job_cost(LOCAL, 16)
    assert speedup(ex(n=16, steps=1, transport="jobs", mode="sync", job_wall_s=job, job_cpu_s=cpu), C) < speedup(
        ex(n=16, steps=1), C)


def test_a_jobs_task_own_cpu_and_its_job_wall_overlap():
    """The empty job's wall holds an empty task's run: the latency bound takes the larger of it and
    the task's CPU beyond training, not their sum."""
    x = ex(n=2, steps=1, transport="jobs", mode="sync", job_wall_s=0.1)
    lean, heavy = replace(C, cpu_jobs_s=0.02), replace(C, cpu_jobs_s=0.3)
    o_lean, o_heavy = exchange_cpu(x, lean)[1], exchange_cpu(x, heavy)[1]
    assert o_lean < 0.1 < o_heavy
    rest = exchange_time(x, lean)["latency"] - T - 0.1  # the driver's share: bytes, apply
    assert rest > 0
    assert exchange_time(x, heavy)["latency"] == pytest.approx(T + o_heavy + rest)
    assert exchange_time(replace(x, job_wall_s=0.05), lean)["latency"] == pytest.approx(T + 0.05 + rest)
    assert exchange_time(replace(x, job_wall_s=0.2), heavy)["latency"] == pytest.approx(T + o_heavy + rest)


def test_payload_sizes():
    assert payload(P, None, SMALL, 3.5) == (4.0 * P, P)
    b, nnz = payload(P, 0.001, SMALL, 3.5)
    assert nnz == pytest.approx(0.001 * (P - SMALL) + SMALL)
    assert 4000 < b < 5000  # measured in training: 4.4 kB per uplink of fmnist_cnn


def synthetic(c: Constants, rng, noise: float, setup: dict = LOCAL) -> dict:
    """A measurement record as bench/_costmeasure.py writes it, generated by the model itself."""
    inputs = {"n": 2, "cores": 2, "bandwidth": 5e9, "params": P, "small_params": SMALL, "batch": 64,
              "bytes_per_nonzero": 3.5, **setup}
    jitter = lambda v: v * (1 + noise * rng.standard_normal())  # noqa: E731
    apply = []
    for kind, e1 in (("0.001", 0.001 * (P - SMALL) + SMALL), ("0.01", 0.01 * (P - SMALL) + SMALL), ("dense", P)):
        for n in (1, 2, 4):
            apply.append({"kind": kind, "payloads": n, "entries": n * e1,
                          "s": jitter(n * c.apply_payload_s + n * e1 * c.apply_entry_s)})
    cases = {}
    for tr, mode in (("jobs", "sync"), ("stream", "async")):
        for h in (1, 10):
            for dense in (True, False):
                case = {"transport": tr, "mode": mode, "steps": h, "dense": dense}
                x = exchange_of(inputs, case)
                o = sum(exchange_cpu(x, c))
                cpu = h * inputs["t_step"] + jitter(o)  # the noise of the CPU beyond training
                case.update(images_per_s=jitter(images_per_s(x, c)),
                            cpu_ms_per_exchange={"driver": 300 * cpu, "jvm": 200 * cpu, "workers": 500 * cpu})
                cases[f"{tr}_{mode}_h{h}_{'dense' if dense else 'sparse'}"] = case
    return {"setup": "synthetic", "inputs": inputs, "cases": cases,
            "micro": {"apply": apply, "select_s_per_param": c.select_s}}


def test_fit_recovers_known_constants():
    exact = fit(synthetic(C, np.random.default_rng(0), 0.0))
    for k, v in asdict(C).items():
        assert getattr(exact, k) == pytest.approx(v, rel=0.01, abs=1e-12), k
    rng = np.random.default_rng(1)
    noisy = fit(synthetic(C, rng, 0.02))
    for k in ("cpu_stream_s", "byte_jobs_s", "share"):
        assert getattr(noisy, k) == pytest.approx(getattr(C, k), rel=0.3), k
    # and what it predicts for a fresh noisy draw of the same setup stays within a few per cent
    errors = [abs(r["error"]) for r in validate(synthetic(C, rng, 0.02), noisy)]
    assert max(errors) < 0.1


def test_constants_carry_across_setups_whose_fixed_costs_differ():
    rng = np.random.default_rng(2)
    for train, test in ((LOCAL, CLUSTER), (CLUSTER, LOCAL)):
        c = fit(synthetic(C, rng, 0.02, train))
        errors = [abs(r["error"]) for r in validate(synthetic(C, rng, 0.02, test), c)]
        assert max(errors) < 0.1
    # the setups' jobs at H = 1 differ by their measured job, not by anything fitted
    h1 = {"transport": "jobs", "mode": "sync", "steps": 1, "dense": False}
    local, cluster = (images_per_s(exchange_of(synthetic(C, rng, 0.0, s)["inputs"], h1), C) for s in (LOCAL, CLUSTER))
    assert local > 2 * cluster


def test_exchange_validates_its_fields():
    with pytest.raises(ValueError, match="Exchange.transport"):
        ex(transport="mail")
    with pytest.raises(ValueError, match="Exchange.mode"):
        ex(mode="eventually")


def test_a_jobs_broadcast_and_result_bytes_cost_the_jobs_transport_only():
    base = dict(steps=1, density_up=None, density_down=None, job_wall_s=0.09, job_cpu_s=0.05)
    bare = {"jobs": ex(transport="jobs", mode="sync", **base), "stream": ex(**base)}
    extra = dict(job_bcast_wall_s=0.02, job_bcast_cpu_s=0.012, job_byte_wall_s=1e-8, job_byte_cpu_s=3e-8)
    moved = 8.0 * P  # dense both ways
    x, y = bare["jobs"], replace(bare["jobs"], **extra)
    # the round's one broadcast is shared by its N tasks' exchanges; every byte pays Spark's result path
    assert exchange_cpu(y, C)[0] - exchange_cpu(x, C)[0] == pytest.approx(0.012 / 2 + 3e-8 * moved)
    assert exchange_time(y, C)["latency"] - exchange_time(x, C)["latency"] == pytest.approx(0.02 + 2 * 1e-8 * moved)
    s = bare["stream"]
    assert exchange_time(replace(s, **extra), C) == exchange_time(s, C)


def test_shared_cores_count_the_steps_cpu_not_their_wall():
    x = ex(n=2, cores=2, steps=10)
    lean = replace(x, t_cpu=0.5 * T)  # a step that waits half its wall leaves CPU to the exchange
    assert exchange_time(lean, C)["cpu"] < exchange_time(x, C)["cpu"]
    assert exchange_time(lean, C)["cpu"] >= 10 * T  # and is never faster than its steps' wall
    assert exchange_time(replace(x, t_cpu=T), C) == exchange_time(x, C)


def test_the_driver_selects_a_downlink_per_async_apply_and_per_sync_round():
    """One downlink per applied result (async), one per round of N exchanges (sync): an
    exchange's share of the driver's selection, σ·P·δ."""
    for transport, mode, per in (("jobs", "async", 1.0), ("jobs", "sync", 0.5), ("stream", "async", 1.0),
                                 ("stream", "sync", 0.5)):
        sparse, plain = ex(transport=transport, mode=mode), ex(transport=transport, mode=mode, density_down=None)
        own = exchange_cpu(sparse, C)[0] - exchange_cpu(plain, C)[0]
        moved = C.byte_stream_s if transport == "stream" else C.byte_jobs_s
        k = sparse.bytes_per_nonzero
        down = payload(P, 0.01, SMALL, k)[0] - payload(P, None, SMALL, k)[0]  # fewer bytes moved
        assert own == pytest.approx(C.select_s * P * per + moved * down / 2), (transport, mode)
