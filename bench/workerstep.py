"""A stream task's CPU per step outside TensorFlow at one step per exchange, part by part.

Prints one JSON object. The case is bench/throughput.py's ``async_h1_sparse`` (stream, async,
H = 1, DGC momentum correction over the sampled threshold: uplink 0.001, downlink 0.01, no
warm-up), on the real model (``fmnist_cnn``, 225,034 parameters) and real Fashion-MNIST rows.
Each repetition is one epoch of a short slice, run in this process without Spark: the real
parameter server (``StreamEngine`` and its Flight service) and the in-process backend, whose
stage trains the two blocks in turn, each alone:

- block 0, ``parts``: the task's per-step path, step by step as the stream task takes it
  (compute from the lookahead's weights, settle the last push's reply, push), each part timed on
  its own thread's CPU clock (``time.thread_time``): ``batches`` (the minibatch's rows and
  augmentation), ``lookahead`` (the extrapolated weights, and the lookahead's observation of each
  reply), ``gradient`` (the gradient call outside TensorFlow: gathering the batch, the tensors;
  the calling thread's CPU inside TF is ``tf``, left out of every total), ``clip`` (the clipping
  factor), ``policy`` (DGC's momentum pass, threshold selection and what it leaves: the policy's
  step), ``encode`` (the codec), ``push`` (the Push message built, encoded and handed to the push
  thread), ``downlink`` (the reply's downlinks decoded and applied to the replica), ``snapshot``
  (the block state kept for a dropped push), ``push_thread`` (the link's push thread: the socket's
  write and read, their MACs, the reply decoded), ``other`` (the rest of the loop: waits, bookkeeping);
  ``total`` is what the task's own meter adds up (its thread outside TF plus the push thread);
- block 1, ``task``: the stream task itself, unchanged; its figure is the one the records carry
  (``task_overhead_cpu_s``, the task's ``CpuMeter``), per step.

Both leave out each block's first and last ``SKIP`` steps (start-up, drain). Per repetition each
figure is its sum over the steps measured / steps; the result is the median over ``--reps``
repetitions (each repetition's in ``repetitions``). With ``--spark-reps N`` > 0, the same case
also runs ``N`` times on the shared ``local[2]`` session through bench/throughput.py's own stream
measure (one epoch of its short slice; ``spark``): the in-run figure
``task_overhead_cpu_ms_per_step``, with images/s and test accuracy, median and each.

With ``--base REV`` the same figures are measured of REV's ``sparkcnn`` (a temporary ``git
worktree``) beside this working tree's, side by side in one run: each repetition, in process and
on Spark, is a child process of its own, base and head in turn (which goes first alternates, so
that a drift of the machine falls on both), after one short untimed repetition of each (numba
compiles the kernels of a new checkout into its cache there, not in a Spark run's executors). The
top-level figures are the head's; ``base`` holds the same keys of REV. This file's loop is run
against both checkouts' modules.

    python bench/workerstep.py [--reps 5] [--steps 300] [--spark-reps 5] [--base REV] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, TimedSink, emit, ensure_data, log, slice_data  # noqa: E402

BATCH, BLOCKS = 64, 2  # bench/throughput.py's
SPARSE = ["compression.method=threshold", "compression.density=0.001", "compression.density_down=0.01",
          "compression.warmup_epochs=0"]  # bench/throughput.py's STREAM_SPARSE
SETTINGS = ["engine.transport=stream", "engine.mode=async", "train.steps_per_round=1", "train.epochs=1",
            f"data.num_blocks={BLOCKS}", f"train.batch_size={BATCH}", *SPARSE]
SKIP = 5  # steps left out at each end of a block's stage
WARM_STEPS = 60  # steps per block of the untimed repetition of each checkout (--base)
PARTS = ("batches", "lookahead", "gradient", "clip", "policy", "encode", "push", "downlink", "snapshot",
         "push_thread", "other")


class Parts:
    """Thread CPU per part, summed over the measured steps."""

    def __init__(self):
        self.sums = dict.fromkeys((*PARTS, "tf", "total"), 0.0)
        self.on = False

    def timed(self, part: str, fn, *args, **kw):
        t = time.thread_time()
        out = fn(*args, **kw)
        if self.on:
            self.sums[part] += time.thread_time() - t
        return out


def instrumented_stage(spec, ticket, block: int, ctx, steps_out: list) -> object:
    """The stream task's loop (``sparkcnn.worker.stream``: overlap on, no faults), its parts timed."""
    from sparkcnn.compression import codec
    from sparkcnn.protocol import Push, StageState, StateArray, StreamTotals
    from sparkcnn.worker import blockstore
    from sparkcnn.worker.jobs import block_batches, clip_scale
    from sparkcnn.worker.streamlink import Link
    from sparkcnn.worker.streamwork import BlockWork
    from sparkcnn.worker.task import freeze_heap_once, start_task

    task = start_task(spec, ctx, block, f"bench block {block}")
    freeze_heap_once()
    link = Link(ticket, block)
    parts = Parts()
    start, _ = link.start()
    plan = start.plan
    work = BlockWork(task, start, None, 0, plan.lookahead)
    state, reset, _ = task.state({}, plan.expect_state)
    work.hold(state)
    trainer, policy, view, look = task.trainer, task.policy, work.view, work.look
    lr, density, send_state = start.lr, start.density, start.send_state
    seq, step, left = plan.seq0, plan.first_step, plan.steps
    last_seq, wait_s, down_bytes, resyncs = -1, 0.0, 0, 0
    pending, measured, exchanges = None, 0, 0
    t_thread, t_tf, t_link = time.thread_time(), trainer.tf_thread_s, link.cpu_s

    def states():
        return tuple(StateArray(k, "float32", a.astype("float32").tobytes())
                     for k, a in sorted(work.state().items()))

    while left > 0 or pending is not None:
        on = SKIP <= plan.steps - left < plan.steps - SKIP
        if on and not parts.on:  # the window opens: every clock from here
            t_thread, t_tf, t_link = time.thread_time(), trainer.tf_thread_s, link.cpu_s
        parts.on = on
        ex = None
        if left > 0:
            before = parts.timed("snapshot", work.snapshot)
            batches, augment = parts.timed("batches", block_batches, spec, block, len(task.labels), step, 1)
            w = parts.timed("lookahead", look.weights, view.weights) if look else view.weights
            base, t0, tf0 = view.version, time.thread_time(), trainer.tf_thread_s
            g, loss_sum, correct, seen = trainer.gradient(task.images, task.labels, batches[0], at=w,
                                                          augment=augment)
            if parts.on:
                tf = trainer.tf_thread_s - tf0
                parts.sums["tf"] += tf
                parts.sums["gradient"] += time.thread_time() - t0 - tf
            scale = parts.timed("clip", clip_scale, g, spec.clip_norm) if spec.clip_norm > 0 else None
            sent = parts.timed("policy", policy.step, g, density, lr=lr, weights=w, scale=scale)
            payload = parts.timed("encode", codec.encode, sent, spec.layout, value_dtype=spec.value_dtype)
            ex = (before, base, sent, payload, loss_sum, correct, seen)
        if pending is not None:
            fut, push, was_before, was_left = pending
            pending = None
            tw = time.perf_counter()
            reply, _ = link.wait(fut)
            wait_s = time.perf_counter() - tw
            down_bytes = parts.timed("downlink", view.take, reply)
            if look:
                parts.timed("lookahead", look.observe, view.weights, view.version, reply.tau, view.changed)
            lr, density, send_state = reply.lr, reply.density, reply.send_state
            if reply.retrain:  # dropped: back to before it, train those steps again
                work.hold(was_before)
                seq, step, left = push.seq, push.first_step, was_left
                continue
            last_seq = push.seq
        if ex is None:
            break
        before, base, sent, payload, loss_sum, correct, seen = ex

        def send():
            push = Push(seq=seq, first_step=step, steps=1, samples=seen, base_version=base, have=view.version,
                        attempt=0, lr=lr, density=density, loss_sum=loss_sum, correct=correct,
                        nnz=int(sent.nnz),
                        compute_s=0.0, wait_s=wait_s, view_bytes=down_bytes, state_reset=reset,
                        replica_resync=view.resyncs > resyncs, pid=os.getpid(), executor=task.executor,
                        payload=payload, state=states() if send_state else ())
            return link.send(push), push

        fut, push = parts.timed("push", send)
        resyncs, reset = view.resyncs, False
        pending = (fut, push, before, left)
        exchanges += 1
        if parts.on:
            measured += 1
        seq, step, left = seq + 1, step + 1, left - 1
        if not (SKIP <= plan.steps - left < plan.steps - SKIP) and parts.on:  # the window closes
            parts.on = False
            meter = (time.thread_time() - t_thread) - (trainer.tf_thread_s - t_tf) + (link.cpu_s - t_link)
            parts.sums["push_thread"] = link.cpu_s - t_link
            parts.sums["total"] = meter
    if last_seq >= 0:
        link.send_state(StageState(last_seq, states()))
        blockstore.save_state(task.root, spec.run_id, block, last_seq, work.state())
    link.close()
    s = parts.sums
    s["other"] = s["total"] - sum(s[p] for p in PARTS if p != "other")
    steps_out.append({p: 1000 * v / max(1, measured) for p, v in s.items()} | {"steps": measured})
    return StreamTotals(block=block, exchanges=exchanges, samples=exchanges * BATCH, last_seq=last_seq,
                        exposed_comm_s=0.0, task_s=0.0)


def one_rep(data: str, out_dir: str, rep: int) -> dict:
    from sparkcnn import config
    from sparkcnn.backends.inprocess import LocalBackend
    from sparkcnn.protocol import StreamTicket
    from sparkcnn.train import build_engine

    got: list = []

    class StepBackend(LocalBackend):
        """In-process; the stage's block 0 runs the instrumented loop, block 1 the task itself."""

        engine = None

        def run_stage(self, fn, universe, description=""):
            svc = self.engine.service
            ticket = StreamTicket(svc.host, svc.port, svc.token)

            def each(block, ctx):
                if block == 0:
                    return instrumented_stage(self.engine.spec, ticket, block, ctx, got)
                return fn(block, ctx)

            return super().run_stage(each, universe, description)

    cfg = config.load(None, [f"data.path={data}", f"run.out_dir={out_dir}", f"run.name=workerstep-{rep}",
                             *SETTINGS])
    backend = StepBackend(f"workerstep-{rep}")
    sink = TimedSink()
    engine, _ = build_engine(cfg, backend, f"workerstep-{rep}", sink=sink)
    backend.engine = engine
    summary = engine.run()
    sink.close()
    rounds = [r for _, r in sink.rounds() if r.get("block") == 1]
    steady = rounds[SKIP:len(rounds) - SKIP]
    steps = sum(r["steps"] for r in steady)
    task_ms = 1000 * sum(r["task_overhead_cpu_s"] or 0.0 for r in steady) / max(1, steps)
    return {"parts": got[0], "task_overhead_cpu_ms_per_step": task_ms, "task_steps": steps,
            "test_accuracy": summary.get("test_accuracy")}


SPARK_KEYS = ("task_overhead_cpu_ms_per_step", "images_per_s", "test_accuracy", "compute_ms_per_step",
              "exposed_comm_ms_per_step")


def spark_run() -> dict:
    """bench/throughput.py's ``async_h1_sparse`` once on the shared local[2] session."""
    from bench import throughput

    h, mode, extra = throughput.STREAM_CASES["async_h1_sparse"]
    r = throughput.measure_stream(throughput.short_slice(ensure_data()), h, mode, extra)
    return {k: r.get(k) for k in SPARK_KEYS}


def spark_summary(each: list[dict]) -> dict:
    """The Spark runs' medians, and each run."""
    from bench import throughput

    return {"reps": len(each), "slice": os.path.basename(throughput.short_slice(ensure_data())),
            "median": {k: statistics.median(e[k] for e in each if e[k] is not None) for k in SPARK_KEYS},
            "repetitions": each}


def figures(reps: list[dict], spark: list[dict]) -> dict:
    """The medians of the in-process repetitions (and of the Spark runs, when there are any)."""
    parts = {p: statistics.median(r["parts"][p] for r in reps) for p in (*PARTS, "tf", "total")}
    out = {"reps": len(reps), "parts_ms_per_step": parts,
           "task_overhead_cpu_ms_per_step": statistics.median(r["task_overhead_cpu_ms_per_step"]
                                                               for r in reps),
           "repetitions": reps}
    if spark:
        out["spark"] = spark_summary(spark)
    return out


def child(tree: str, what: str, data: str, steps: int) -> dict:
    """One repetition (``what``: ``rep``, in process, or ``spark``) of ``tree``'s sparkcnn in a child
    process: its JSON line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])),
               PYSPARK_PYTHON=sys.executable, TF_CPP_MIN_LOG_LEVEL="2")
    got = subprocess.run([sys.executable, os.path.abspath(__file__), "--tree", tree, "--one", what,
                          "--data", data, "--steps", str(steps)], env=env, cwd=tree, capture_output=True,
                         text=True, check=False)
    if got.returncode != 0:
        raise SystemExit(f"workerstep: a {what} repetition in {os.path.basename(tree)} failed: "
                         f"{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def side_by_side(a, data: str) -> tuple[dict, dict]:
    """(base, head) figures, each repetition a child process, base and head in turn (module docstring)."""
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", f"{a.base}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    runs = {"base": ([], []), "head": ([], [])}
    with tempfile.TemporaryDirectory(prefix="sparkcnn-workerstep-base-") as tmp:
        dirs = {"base": os.path.join(tmp, "base"), "head": ROOT}
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", dirs["base"], commit], check=True,
                       capture_output=True)
        try:
            for name in ("base", "head"):  # untimed: compiles the kernels into a new checkout's cache
                child(dirs[name], "rep", data, WARM_STEPS)
            for slot, what, n in ((0, "rep", a.reps), (1, "spark", a.spark_reps)):
                for i in range(n):
                    for name in (("base", "head") if i % 2 == 0 else ("head", "base")):
                        r = child(dirs[name], what, data, a.steps)
                        log("%s %s %d: %s", name, what, i, json.dumps(r.get("parts", r))[:160])
                        runs[name][slot].append(r)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", dirs["base"]],
                           capture_output=True, check=False)
    base = {"rev": a.base, "commit": commit, **figures(*runs["base"])}
    return base, figures(*runs["head"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions in process (figures: their medians)")
    ap.add_argument("--steps", type=int, default=300, help="steps per block and repetition")
    ap.add_argument("--spark-reps", type=int, default=5, help="runs of the case on local[2] (0: none)")
    ap.add_argument("--base", help="a revision measured beside this working tree, in one run (docstring)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # a child: the checkout whose sparkcnn it measures
    ap.add_argument("--one", choices=("rep", "spark"), help=argparse.SUPPRESS)  # a child's one repetition
    ap.add_argument("--data", help=argparse.SUPPRESS)  # a child's slice
    a = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if a.one:  # a child: sparkcnn is the tree's (PYTHONPATH), ahead of this file's checkout
        sys.path.insert(0, os.path.abspath(a.tree))
        tmp = tempfile.mkdtemp(prefix="sparkcnn-workerstep-")
        r = one_rep(a.data, tmp, 0) if a.one == "rep" else spark_run()
        print(json.dumps(r))
        return r
    data = slice_data(ensure_data(), BLOCKS * a.steps * BATCH, 1000)
    out = {"bench": "workerstep", "model": "fmnist_cnn", "settings": SETTINGS, "steps_per_block": a.steps,
           "skip_steps": SKIP}
    if a.base:
        base, head = side_by_side(a, data)
        out.update(head, base=base)
    else:
        tmp = tempfile.mkdtemp(prefix="sparkcnn-workerstep-")
        reps = []
        for i in range(a.reps):
            r = one_rep(data, tmp, i)
            log("rep %d: parts total %.3f ms/step (policy %.3f), task %.3f ms/step", i, r["parts"]["total"],
                r["parts"]["policy"], r["task_overhead_cpu_ms_per_step"])
            reps.append(r)
        if a.spark_reps > 0:
            log("the throughput case on local[2], %d runs", a.spark_reps)
        out.update(figures(reps, [spark_run() for _ in range(a.spark_reps)]))
    emit(out, a.out)
    return out


if __name__ == "__main__":
    main()
