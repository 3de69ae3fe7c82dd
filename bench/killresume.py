"""A stream run whose driver is SIGKILLed mid-epoch resumes as if it had not been.

For each case (the stream, async H = 1, async H = 10, sync H = 10; conf/fashion_mnist.yaml,
``--epochs`` (2) epochs, ``checkpoint.every_rounds`` 20, seed 42) three CLI invocations of
``sparkcnn train``:

1. unkilled: the reference;
2. killed: ``chaos.kill_driver_round`` at ``--kill-at`` (0.75) of the run's exchanges, mid
   last epoch; the JSON counts the checkpoints it wrote (``checkpoint ... saved`` at INFO)
   and keeps its metrics records;
3. ``--resume`` of the killed run directory.

Checks per case: ``>= 3`` checkpoints before the kill; the records the last checkpoint
covers unchanged after the resume; no exchange recorded twice (records number them from 0
without gaps); every epoch complete; the resumed run's final test accuracy within 1 point
of the unkilled one's. Prints one JSON object; exit 0 when every check holds, 1 otherwise.

    python bench/killresume.py [--epochs N] [--cases a,b] [--out FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import ROOT, emit, ensure_data, log  # noqa: E402

CASES = {"async-h1": ["engine.mode=async", "train.steps_per_round=1"],
         "async-h10": ["engine.mode=async", "train.steps_per_round=10"],
         "sync-h10": ["engine.mode=sync", "train.steps_per_round=10"]}
EVERY = 20          # checkpoint.every_rounds: at most one per 50x the last one's cost on the stream
POINTS = 0.01       # the resumed run's accuracy within 1 point of the unkilled run's


def _cli(args: list[str], timeout: float = 3600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "sparkcnn", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _train(data: str, out_dir: str, case: list[str], epochs: int, extra: list[str] = ()) -> tuple:
    args = ["-v", "train", "--config", "conf/fashion_mnist.yaml", "--no-progress",
            *[x for kv in [f"data.path={data}", f"run.out_dir={out_dir}", f"train.epochs={epochs}",
                           "engine.transport=stream", f"checkpoint.every_rounds={EVERY}", *case, *extra]
              for x in ("--set", kv)]]
    t0 = time.perf_counter()
    proc = _cli(args)
    return proc, time.perf_counter() - t0


def run_case(name: str, data: str, epochs: int, kill_at: float, root: str) -> dict:
    case = CASES[name]
    log("%s: unkilled", name)
    ref, ref_s = _train(data, os.path.join(root, name, "ref"), case, epochs)
    if ref.returncode != 0:
        return {"error": "unkilled run failed: " + ref.stderr.strip().splitlines()[-1]}
    ref_summary = json.loads(ref.stdout)
    exchanges = ref_summary["rounds"]
    kill = int(kill_at * exchanges)
    log("%s: killed after exchange %d of %d", name, kill, exchanges)
    killed, killed_s = _train(data, os.path.join(root, name, "run"), case, epochs,
                              [f"chaos.kill_driver_round={kill}"])
    (run_dir,) = glob.glob(os.path.join(root, name, "run", "*"))
    before = _records(run_dir)
    with open(os.path.join(run_dir, "checkpoints", "LATEST")) as f:
        latest = f.read().strip()
    with open(os.path.join(run_dir, "checkpoints", latest, "state.json")) as f:
        covered = json.load(f)["records"]
    log("%s: resume", name)
    t0 = time.perf_counter()
    resumed = _cli(["train", "--no-progress", "--resume", run_dir, "--set", "chaos.kill_driver_round=-1"])
    resumed_s = time.perf_counter() - t0
    if resumed.returncode != 0:
        return {"error": "resume failed: " + resumed.stderr.strip().splitlines()[-1]}
    summary = json.loads(resumed.stdout)
    after = _records(run_dir)
    rounds = [r for r in after if r["kind"] == "round"]
    epochs_done = [r["epoch"] for r in after if r["kind"] == "epoch"]
    checks = {
        "killed_by_sigkill": killed.returncode == -9,
        "checkpoints_before_kill_ge_3": len(re.findall(r"checkpoint \S+ saved", killed.stderr)) >= 3,
        "records_to_last_checkpoint_unchanged": 0 < covered < len(before) and after[:covered] == before[:covered],
        "no_exchange_recorded_twice": [r["round"] for r in rounds] == list(range(len(rounds))),
        "every_epoch_complete": epochs_done == list(range(epochs)) and len(rounds) == exchanges,
        "accuracy_within_1_point": abs(summary["test_accuracy"] - ref_summary["test_accuracy"]) <= POINTS,
    }
    return {"settings": case, "exchanges": exchanges, "killed_after_exchange": kill,
            "checkpoints_before_kill": len(re.findall(r"checkpoint \S+ saved", killed.stderr)),
            "records_covered_by_last_checkpoint": covered, "records_when_killed": len(before),
            "exchanges_retrained": len([r for r in before if r["kind"] == "round"]) - len(
                [r for r in before[:covered] if r["kind"] == "round"]),
            "test_accuracy_unkilled": ref_summary["test_accuracy"], "test_accuracy_resumed": summary["test_accuracy"],
            "delta_points": round(100 * (summary["test_accuracy"] - ref_summary["test_accuracy"]), 2),
            "wall_s": {"unkilled": ref_s, "killed": killed_s, "resumed": resumed_s},
            "checks": checks, "passed": all(checks.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--kill-at", type=float, default=0.75, help="fraction of the run's exchanges")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown or not 0 < a.kill_at < 1 or a.epochs < 1:
        print(f"killresume: unknown case {unknown} or --kill-at/--epochs out of range", file=sys.stderr)
        return 2
    data = ensure_data()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparkcnn-killresume-") as root:
        cases = {n: run_case(n, data, a.epochs, a.kill_at, root) for n in names}
    out = {"epochs": a.epochs, "kill_at": a.kill_at, "checkpoint_every_rounds": EVERY, "cases": cases,
           "passed": all(c.get("passed", False) for c in cases.values()), "bench_wall_s": time.perf_counter() - t0}
    emit(out, a.out)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
