"""The project's rule for judging a benchmark target, and every target of a results folder.

A target holds or misses only on enough evidence (``judge``):

- a speed or latency target on the median of at least ``MIN_REPS`` (5) repetitions;
- a tail latency (a p99) on every repetition: one repetition over the bound misses it;
- an accuracy target on the mean of at least ``MIN_SEEDS`` (2) seeds, shown with their sd;
- a count (bytes sent, seeds collapsed) as it is.

With fewer repetitions or seeds a target is "not judged", whatever the bench printed. The bench's
own verdict (``targets_met``, ``checks``, ``met``, ``passed``) is what holds on the median; the
rule decides whether there is enough behind it. ``of_folder`` gives every target of the JSONs a
render reads, one ``Target`` per target the benches judge, so the document can show each of them,
holding or not, and ``summary`` the line that counts them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIN_REPS = 5  # speed and latency: the median of at least this many repetitions
MIN_SEEDS = 2  # accuracy: the mean of at least this many seeds, with its sd
LONG_SEEDS = 1  # the longer CIFAR-10 run's accuracy: its target asks for one seed

HOLDS, MISSES, NOT_JUDGED = "holds", "misses", "not judged"
SPEED, TAIL, ACCURACY, COUNT = "speed", "tail", "accuracy", "count"


@dataclass(frozen=True)
class Target:
    """One target as the document shows it."""

    name: str  # what is targeted, with its bound ("stream.async_h10.efficiency_vs_limit >= 0.93")
    figure: str  # the measured figure it is judged on, with the test accuracy of the same run for a speed
    verdict: str  # HOLDS, MISSES or NOT_JUDGED
    evidence: str  # the repetitions or seeds behind it, and why it is not judged when it is not


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def judge(kind: str, n: int | None, met: bool | None, each_met: list[bool] | None = None,
          need: int | None = None) -> tuple[str, str]:
    """(verdict, evidence) of a target of ``kind`` measured ``n`` times, which the bench judged
    ``met`` (on the median, or the mean over seeds); a TAIL target needs ``each_met``, one per
    repetition. ``need``: the repetitions or seeds the target's own statement asks for, where it
    names them (else the rule's)."""
    unit = {ACCURACY: "seed", COUNT: "run"}.get(kind, "repetition")
    need = need or {SPEED: MIN_REPS, TAIL: MIN_REPS, ACCURACY: MIN_SEEDS, COUNT: 1}[kind]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return NOT_JUDGED, f"{unit}s not recorded"
    said = _plural(n, unit)
    if n < need:
        return NOT_JUDGED, f"{said} (needs {need})"
    if kind == TAIL:
        if not each_met or len(each_met) != n:
            return NOT_JUDGED, f"{said}, each repetition's figure not recorded"
        missed = sum(not x for x in each_met)
        return (MISSES, f"{said}, {missed} over the bound") if missed else (HOLDS, f"{said}, every one")
    if met is None:
        return NOT_JUDGED, f"{said}, no verdict recorded"
    return (HOLDS if met else MISSES), said + (", median" if kind == SPEED else ", mean" if kind == ACCURACY else "")


def summary(targets: list[Target]) -> str:
    """"k hold, m miss, j not judged, of n"."""
    count = {v: sum(t.verdict == v for t in targets) for v in (HOLDS, MISSES, NOT_JUDGED)}
    return f"{count[HOLDS]} hold, {count[MISSES]} miss, {count[NOT_JUDGED]} not judged, of {len(targets)}"


def missed(targets: list[Target]) -> list[str]:
    return [t.name for t in targets if t.verdict == MISSES]


# ---- reading the JSONs (any field may be missing: old schemas render, never crash) ---------------

def _get(d, *keys):
    """``d[k0][k1]...``, or None where a level is missing or not a dict (bench/render.py's too)."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fmt(x, decimals: int = 4) -> str:
    return f"{x:.{decimals}f}" if _num(x) else "—"


def _pm(mean, sd, decimals: int = 4) -> str:
    return _fmt(mean, decimals) + (f" ± {_fmt(sd, decimals)}" if _num(sd) else "")


def _bool(x) -> bool | None:
    return x if isinstance(x, bool) else None


def of_accuracy(acc: dict | None) -> list[Target]:
    """accuracy.json's ``checks``: each over the seeds of the rows it names."""
    rows = {r.get("name"): r for key in ("runs", "stream") for r in (_get(acc, key) or [])
            if isinstance(r, dict)}
    out = []
    for name, met in (_get(acc, "checks") or {}).items():
        names = [n for n in re.findall(r"[a-z][a-z0-9-]*[a-z0-9]", name) if n in rows]
        seeds = [len(rows[n].get("seeds") or []) for n in names]
        n = min(seeds) if seeds else None
        first = rows.get(names[0], {}) if names else {}
        if "ratio" in name:
            key = re.search(r"(steady_\w+_ratio)", name)[1]
            kind, figure = COUNT, f"{_fmt(first.get(f'{key}_mean'), 1)} (mean over seeds)"
        elif "faster than" in name:
            kind = SPEED
            figure = " against ".join(f"{_fmt(_get(rows, m, 'wall_s_mean'), 1)} s" for m in names)
        elif "collapsed" in name:
            kind, figure = ACCURACY, f"{first.get('collapsed', '—')} collapsed"
        else:
            kind = ACCURACY
            figure = " against ".join(_pm(_get(rows, m, "test_accuracy_mean"), _get(rows, m, "test_accuracy_std"))
                                      for m in names)
        out.append(Target(name, figure, *judge(kind, n, _bool(met))))
    return out


# throughput.json's target keys -> (the measurement holding the figure, the figure's key)
_THROUGHPUT_PATHS = {"ratio_vs_keras@50": (("by_steps_per_round", "50"), "ratio_vs_keras"),
                     "efficiency_vs_limit@50": (("by_steps_per_round", "50"), "efficiency_vs_limit"),
                     "pipelined.efficiency_vs_limit@10": (("pipelined",), "efficiency_vs_limit"),
                     "async.efficiency_vs_limit@10": (("async",), "efficiency_vs_limit"),
                     "sync_pipelined_idle_fraction": (("pipelined",), "idle_fraction"),
                     "async_vs_sync": (("async",), "async_vs_sync")}


def run_limit(thr: dict | None) -> dict | None:
    """The one compute limit of a throughput run, measured once with its repetitions
    (``compute_limit``: images_per_s, the median, and ``repetitions``); None in older files,
    whose cases divide by limits of their own."""
    lim = _get(thr, "compute_limit")
    reps = _get(lim, "repetitions")
    if _num(_get(lim, "images_per_s")) and isinstance(reps, list) and reps:
        return lim
    return None


def _reps(m) -> int:
    reps = _get(m, "repetitions")
    return len(reps) if isinstance(reps, list) else reps if isinstance(reps, int) and reps > 0 else 1


def accuracy_note(m) -> str:
    """The test accuracy of the run a speed figure comes from, or that it is missing."""
    acc = _get(m, "test_accuracy")
    return f"test accuracy {_fmt(acc)}" if _num(acc) else "test accuracy missing"


def of_throughput(thr: dict | None) -> list[Target]:
    """throughput.json's ``targets``: speed targets, each on the median of its repetitions; an
    efficiency only against the run's one limit, and only for a run that trained."""
    out = []
    met = _get(thr, "targets_met") or {}
    for key, bound in (_get(thr, "targets") or {}).items():
        if key.startswith("stream."):
            case = key.split(".")[1]
            m, fig_key = _get(thr, "stream", case), key.split(".", 2)[2]
        else:
            path, fig_key = _THROUGHPUT_PATHS.get(key, ((), key))
            m = _get(thr, *path) if path else thr
        x = _get(thr, fig_key) if fig_key == "async_vs_sync" else _get(m, fig_key)
        figure = f"{_fmt(x, 3)} ({accuracy_note(m)})"
        verdict, evidence = judge(SPEED, _reps(m), _bool(met.get(key)))
        if verdict != NOT_JUDGED and "efficiency" in key and run_limit(thr) is None:
            verdict, evidence = NOT_JUDGED, evidence + "; no single limit for the run"
        if verdict != NOT_JUDGED and _get(m, "trained") is False:
            verdict, evidence = MISSES, evidence + "; did not train"
        elif verdict != NOT_JUDGED and not _num(_get(m, "test_accuracy")):
            verdict, evidence = NOT_JUDGED, evidence + "; no test accuracy"
        out.append(Target(f"{key} {bound}", figure, verdict, evidence))
    return out


def of_targets_met(doc: dict | None, kind: str = SPEED) -> list[Target]:
    """A bench's flat ``targets`` and ``targets_met`` (balance.json), repetitions from ``reps``."""
    met = _get(doc, "targets_met") or {}
    n = _get(doc, "reps") if isinstance(_get(doc, "reps"), int) else 1
    return [Target(f"{k} {bound}", _fmt(_get(doc, k), 3), *judge(kind, n, _bool(met.get(k))))
            for k, bound in (_get(doc, "targets") or {}).items()]


def of_scale(sc: dict | None) -> list[Target]:
    """scale.json lists targets without a verdict: each is shown, not judged."""
    out = []
    for k, bound in (_get(sc, "targets") or {}).items():
        for sub, b in (bound.items() if isinstance(bound, dict) else [("", bound)]):
            name = f"{k}[{sub}] {b}" if sub else f"{k} {b}"
            out.append(Target(name, _fmt(_get(sc, k, sub) if sub else _get(sc, k), 3), NOT_JUDGED,
                              "no verdict recorded"))
    return out


def of_costmodel(cm: dict | None) -> list[Target]:
    if cm is None or "within_25pct" not in cm:
        return []
    return [Target("largest held-out error <= 25 %", _fmt(_get(cm, "max_abs_error"), 3),
                   *judge(SPEED, None, _bool(cm.get("within_25pct"))))]


def of_links(ln: dict | None) -> list[Target]:
    """links.json's ``checks``: the trained gates (accuracy) and the speed-ups (speed)."""
    n = _get(ln, "reps") if isinstance(_get(ln, "reps"), int) else 1
    out = []
    for k, v in (_get(ln, "checks") or {}).items():
        if not isinstance(v, dict):
            continue
        if "gate" in v:
            out.append(Target(f"{k}: test accuracy >= {v['gate']}", _fmt(v.get("test_accuracy")),
                              *judge(ACCURACY, n, _bool(v.get("passed")))))
        else:
            out.append(Target(f"{k} >= {v.get('target')}", _fmt(v.get("ratio"), 3),
                              *judge(SPEED, n, _bool(v.get("passed")))))
    return out


def of_linkmodel(lm: dict | None) -> list[Target]:
    if lm is None or "passed" not in lm:
        return []
    n = _get(lm, "links", "reps")
    return [Target(f"largest held-out error <= {_fmt(_get(lm, 'target'), 2)}",
                   _fmt(_get(lm, "max_abs_held_out_error"), 3),
                   *judge(SPEED, n if isinstance(n, int) else 1, _bool(lm.get("passed"))))]


def of_psload(pl: dict | None) -> list[Target]:
    """The load target: pushes/s on the median of the repetitions, the reply p99 on every one; and
    beside it the servers' target (``of_servers``), when the run measured one."""
    t = _get(pl, "target")
    if not isinstance(t, dict):
        return of_cpu(pl) + of_servers(pl)
    at = t.get("at_workers")
    case = next((c for c in (_get(pl, "cases") or []) if isinstance(c, dict) and c.get("workers") == at
                 and c.get("shards", 1) == 1 and c.get("servers", 1) == 1), {})
    n = _reps(case)
    each = [e for e in (case.get("each") or []) if isinstance(e, dict)] or ([case] if n == 1 else [])
    p99s = [_get(e, "reply_ms", "p99") for e in each]
    speed_met = _num(case.get("pushes_per_s")) and case["pushes_per_s"] >= t.get("pushes_per_s", float("inf"))
    speed = judge(SPEED, n, bool(speed_met) and not case.get("refused"))
    tail = judge(TAIL, n, None, [_num(p) and p < t.get("p99_ms", 0) for p in p99s])
    verdicts = {speed[0], tail[0]}
    verdict = MISSES if MISSES in verdicts else NOT_JUDGED if NOT_JUDGED in verdicts else HOLDS
    figure = (f"{_fmt(case.get('pushes_per_s'), 0)} pushes/s (median); p99 per repetition: "
              + (", ".join(_fmt(p, 1) for p in p99s) or "—") + " ms")
    return [Target(f"{_fmt(t.get('pushes_per_s'), 0)} pushes/s with reply p99 < {_fmt(t.get('p99_ms'), 0)} ms "
                   f"at {at} workers", figure, verdict, f"pushes/s: {speed[1]}; p99: {tail[1]}"),
            *of_cpu(pl), *of_servers(pl)]


def of_cpu(pl: dict | None) -> list[Target]:
    """psload's floor target: one server's CPU per push on the median of the repetitions, with the
    reply p99 under its bound in every one."""
    ct = _get(pl, "cpu_target")
    if not isinstance(ct, dict):
        return []
    n, p99s = ct.get("repetitions"), list(ct.get("p99_each") or [])
    cpu = judge(SPEED, n, _num(ct.get("server_cpu_ms_per_push"))
                and ct["server_cpu_ms_per_push"] <= ct.get("ms_per_push", 0))
    tail = judge(TAIL, n, None, [_num(p) and p < ct.get("p99_ms", 0) for p in p99s])
    verdicts = {cpu[0], tail[0]}
    verdict = MISSES if MISSES in verdicts else NOT_JUDGED if NOT_JUDGED in verdicts else HOLDS
    parts = ct.get("parts_ms_per_push") or {}
    figure = (f"{_fmt(ct.get('server_cpu_ms_per_push'), 3)} ms/push (median)"
              + (" = " + " + ".join(f"{k} {_fmt(v, 3)}" for k, v in parts.items()) if parts else "")
              + "; p99 per repetition: " + (", ".join(_fmt(p, 1) for p in p99s) or "—") + " ms")
    return [Target(f"one server at {_fmt(ct.get('offered_pushes_per_s'), 0)} pushes/s from "
                   f"{_fmt(ct.get('at_workers'), 0)} workers: CPU per push "
                   f"<= {_fmt(ct.get('ms_per_push'), 1)} ms, "
                   f"reply p99 < {_fmt(ct.get('p99_ms'), 0)} ms", figure, verdict,
                   f"CPU: {cpu[1]}; p99: {tail[1]}")]


def of_servers(pl: dict | None) -> list[Target]:
    """psload's servers target: K = 2 server processes' summed CPU per push within its bound of
    K = 1's at every N measured with both, on the medians of the repetitions."""
    st = _get(pl, "servers_target")
    if not isinstance(st, dict):
        return []
    ratios = _get(st, "cpu_ratio") or {}
    figure = "; ".join(f"N = {n}: {_fmt(r, 3)}x" for n, r in ratios.items()) or "—"
    within = st.get("within")
    bound = f"{within * 100:.0f} %" if _num(within) else "—"
    return [Target(f"K = {_fmt(st.get('servers'), 0)} server processes: summed CPU per push within {bound} "
                   "of K = 1's", f"K = 2 over K = 1: {figure}",
                   *judge(SPEED, st.get("repetitions"), _bool(st.get("met"))))]


def of_shardmodel(sm: dict | None, pl: dict | None = None) -> list[Target]:
    """The predicted speed-up's target, on the repetitions of the psload costs it was fitted on."""
    t = _get(sm, "target")
    if not isinstance(t, dict):
        return []
    at = _get(sm, "fitted_at_workers")
    case = next((c for c in (_get(pl, "cases") or []) if isinstance(c, dict) and c.get("workers") == at), None)
    n = _reps(case) if case else None
    best = (_get(sm, "best_shards") or {}).items()
    figure = ", ".join(f"N = {nn}: {_fmt(_get(sm, 'by_shards', str(k), 'speed_up', nn), 1)}" for nn, k in best) or "—"
    return [Target(f"speed-up >= {t.get('fraction_of_n')} N up to N = {t.get('up_to')} with the best K",
                   f"best speed-ups by N: {figure}", *judge(SPEED, n, _bool(t.get("met"))))]


def of_cifar(cif: dict | None) -> list[Target]:
    """The CIFAR-10 bench's gate: every mode's run trained, so that its speed figure counts."""
    t = _get(cif, "target")
    if not isinstance(t, dict):
        return []
    modes = [m for m in (_get(cif, "modes") or []) if isinstance(m, dict)]
    figure = "; ".join(f"{m.get('mode')}: {_fmt(m.get('test_accuracy'), 3)}" for m in modes) or "—"
    return [Target(f"every mode's test accuracy >= {_fmt(t.get('trained_at_least'), 2)} (its run trained)",
                   figure, *judge(COUNT, 1, _bool(t.get("met"))))]


def of_firststep(fs: dict | None) -> list[Target]:
    """A run's start-up: the median seconds from the process's start to its first step."""
    t = _get(fs, "target")
    if not isinstance(t, dict):
        return []
    each = ", ".join(_fmt(_get(r, "first_step_s"), 1) for r in (_get(fs, "each") or []))
    return [Target(f"first step within {_fmt(t.get('first_step_s_at_most'), 0)} s of the process's start",
                   f"{_fmt(_get(fs, 'median_first_step_s'), 1)} s (median; each: {each or '—'} s)",
                   *judge(SPEED, t.get("repetitions"), _bool(t.get("met"))))]


def of_servermodel(sv: dict | None) -> list[Target]:
    """The servers' model: its predicted speed-up at N = 64 on a driver host of at most 8 cores, on
    the repetitions of the psload costs it read; and its check on the held-out capacities."""
    t, v = _get(sv, "target"), _get(sv, "validation")
    if not isinstance(t, dict) or not isinstance(v, dict):
        return []
    n, at = _get(sv, "repetitions"), t.get("at_workers")
    best = _get(sv, "best_servers", str(at))
    held = "; ".join(f"K = {k}: {_fmt(_get(x, 'error') * 100 if _num(_get(x, 'error')) else None, 1)} %"
                     for k, x in (v.get("by_servers") or {}).items())
    return [Target(f"predicted speed-up >= {t.get('fraction_of_n')} N at N = {at} with K server processes on "
                   f"a driver host of at most {t.get('cores_at_most')} cores",
                   f"{_fmt(t.get('speed_up'), 1)} at K = {best} on {_fmt(_get(sv, 'cores'), 0)} cores",
                   *judge(SPEED, n, _bool(t.get("met")))),
            Target(f"the model within {_fmt((v.get('within') or 0) * 100, 0)} % on held-out capacities "
                   f"(N = {v.get('held_out_workers')}, fitted at N = {v.get('fitted_at_workers')})",
                   f"errors: {held or '—'}", *judge(SPEED, n, _bool(v.get("passed"))))]


MOMENTUM_GAP = -0.3  # points: SAMomentum within 0.3 points of momentum correction at N = 8, or better


def _seeds(form) -> int:
    """Seeds behind one cell of momentum.json: its ``accuracies``, else its ``seeds`` (a count or a list)."""
    if not isinstance(form, dict):
        return 0
    for x in (form.get("accuracies"), form.get("seeds")):
        if isinstance(x, list):
            return len(x)
        if isinstance(x, int) and not isinstance(x, bool):
            return x
    return 0


def of_momentum(mo: dict | None) -> list[Target]:
    """SAMomentum against momentum correction at N = 8, per setting: on the mean over seeds."""
    out = []
    for r in _get(mo, "summary") or []:
        if not isinstance(r, dict) or r.get("blocks") != 8 or not _num(r.get("samomentum_minus_correction_points")):
            continue
        gap = r["samomentum_minus_correction_points"]
        forms = [_get(r, f) for f in ("sparsification_aware", "correction")]
        seeds = [_seeds(f) for f in forms]
        n = min(seeds) if seeds else None
        figure = (f"{gap:.2f} points (" + " against ".join(_pm(_get(f, "mean"), _get(f, "sd")) for f in forms) + ")")
        out.append(Target(f"`{r.get('setting')}`, N = 8: SAMomentum − correction >= {MOMENTUM_GAP} points", figure,
                          *judge(ACCURACY, n, gap >= MOMENTUM_GAP)))
    return out


def _row_accuracy(row) -> tuple[float | None, float | None, int, int]:
    """(mean, sd, seeds, seeds collapsed) of a row of accuracy-cifar10.json (an aggregate over seeds)."""
    if not isinstance(row, dict):
        return None, None, 0, 0
    mean, sd = row.get("test_accuracy_mean"), row.get("test_accuracy_std")
    collapsed = row.get("collapsed") if _num(row.get("collapsed")) else 0
    return (mean if _num(mean) else None), (sd if _num(sd) else None), _seeds(row), collapsed


def _gaps(rows: list, base, bound) -> tuple[str, int | None, bool | None]:
    """(figure, seeds, met) of ``rows`` each within ``bound`` points of ``base`` or above it: each
    row's mean minus the base's, in points; seeds, the fewest any of them ran. A row with a
    collapsed seed misses; a missing mean (or bound) leaves it undecided (None)."""
    b_mean, _, b_n, _ = _row_accuracy(base)
    parts, ns, met = [], [b_n], [] if _num(bound) else [None]  # (1e-9: a mean at the bound, in floats)
    for r in rows:
        mean, sd, n, collapsed = _row_accuracy(r)
        ns.append(n)
        gap = 100 * (mean - b_mean) if mean is not None and b_mean is not None else None
        met.append(False if collapsed else None if gap is None or not _num(bound) else gap >= -bound - 1e-9)
        parts.append(f"{r.get('name', '—')} {_pm(mean, sd)} ({_fmt(gap, 2)} points"
                     + (f", {collapsed} collapsed)" if collapsed else ")"))
    verdict = False if False in met else None if None in met or not rows else True
    return "; ".join(parts) or "—", (min(ns) if rows and min(ns) > 0 else None), verdict


def of_accuracy_cifar(doc: dict | None) -> list[Target]:
    """accuracy-cifar10.json's three targets, each on the mean of at least MIN_SEEDS seeds: every
    distributed row within ``within_keras_points`` of the Keras row at the same epochs; GS-ASGD
    and GS-ASGD + MS within ``within_asgd_points`` of ASGD or above it; the longer GS-ASGD + MS
    run >= ``long_at_least``. A row with a collapsed seed misses its bound."""
    t = _get(doc, "targets")
    if not isinstance(t, dict):
        return []
    rows = {r.get("name"): r for r in (_get(doc, "rows") or []) if isinstance(r, dict)}
    keras, epochs = _get(doc, "keras"), _get(doc, "epochs")
    out = []
    bound = t.get("within_keras_points")
    figure, n, met = _gaps(list(rows.values()), keras, bound)
    k_mean, k_sd, _, _ = _row_accuracy(keras)
    out.append(Target(f"every distributed row within {_fmt(bound, 1)} points of Keras `model.fit` at "
                      f"{_fmt(epochs, 0)} epochs", f"Keras {_pm(k_mean, k_sd)}; {figure}",
                      *judge(ACCURACY, n, met)))
    bound = t.get("within_asgd_points")
    sparse = [rows[k] for k in ("stream-gs-asgd", "stream-gs-asgd-ms") if k in rows]
    figure, n, met = _gaps(sparse, rows.get("stream-asgd"), bound)
    met = met if len(sparse) == 2 else None  # both rows, or no verdict
    a_mean, a_sd, _, _ = _row_accuracy(rows.get("stream-asgd"))
    out.append(Target(f"GS-ASGD and GS-ASGD + MS within {_fmt(bound, 1)} points of ASGD or above it "
                      "(the seeds' claim)", f"ASGD {_pm(a_mean, a_sd)}; {figure}", *judge(ACCURACY, n, met)))
    bound, long = t.get("long_at_least"), _get(doc, "long")
    mean, sd, n, collapsed = _row_accuracy(long)
    met = None if mean is None or not _num(bound) else (mean >= bound and not collapsed)
    # the target's own statement: "one seed is enough for that row"
    out.append(Target(f"GS-ASGD + MS, {_get(long, 'model') or 'ResNet-20'}, {_fmt(_get(long, 'epochs'), 0)} "
                      f"epochs at {_fmt(_get(long, 'blocks'), 0)} blocks: test accuracy >= {_fmt(bound, 2)}",
                      _pm(mean, sd) + (f" ({collapsed} collapsed)" if collapsed else ""),
                      *judge(ACCURACY, n or None, met, need=LONG_SEEDS)))
    return out


def of_folder(docs: dict[str, dict | None]) -> dict[str, list[Target]]:
    """bench name -> its targets, for the JSONs a render reads (name -> parsed JSON or None)."""
    return {"accuracy": of_accuracy(docs.get("accuracy")), "momentum": of_momentum(docs.get("momentum")),
            "throughput": of_throughput(docs.get("throughput")), "scale": of_scale(docs.get("scale")),
            "costmodel": of_costmodel(docs.get("costmodel")), "links": of_links(docs.get("links")),
            "linkmodel": of_linkmodel(docs.get("linkmodel")), "psload": of_psload(docs.get("psload")),
            "shardmodel": of_shardmodel(docs.get("shardmodel"), docs.get("psload")),
            "servermodel": of_servermodel(docs.get("servermodel")), "cifar": of_cifar(docs.get("cifar")),
            "firststep": of_firststep(docs.get("firststep")),
            "balance": of_targets_met(docs.get("balance")),
            "accuracy-cifar10": of_accuracy_cifar(docs.get("accuracy-cifar10")),
            "links-cifar10": of_links(docs.get("links-cifar10"))}


def of_result(name: str, doc: dict | None) -> list[Target]:
    """The targets of one bench's result (what its exit status is judged on)."""
    return of_folder({name: doc}).get(name, [])

