"""The cost model on held-out links: fitted at unshaped and 1 Gbit/s, predicting 100 and 20 Mbit/s.

Runs ``bench/links.py`` on its 2-host test bed at four link rates (``FIT_RATES`` then
``HELD_OUT``; short runs: ``--train-rows`` rows, ``--epochs``; each cell the median of ``--reps``
repetitions, the rates in turn within each, since one short cell's images/s varied by ~15 % from
run to run and its slowest held-out cell missed the target in one of two single runs), or reads
such a run (``--links``),
fits the model below on the unshaped and 1 Gbit/s cells and predicts the images/s of every
100 and 20 Mbit/s cell from the unshaped cell of its variant and the fitted constant. No
figure of a held-out cell (its time, its bytes) is an input.

Per exchange of one block (H local steps of batch b, N blocks; each host behind its own link of
B bytes/s in each direction, the driver's side unshaped)::

    T0      = N·H·b / images/s of the variant's unshaped cell   seconds per exchange, no link cost
    x_q     = bytes up + bytes down of one block's exchange, at the midpoints q of 20 equal slices
              of the run's exchanges (the density warm-up's first exchanges weigh several times the
              last ones), from the same unshaped cell; x its mean
    T_cpu   = T0 + β·x_q        every shaped byte costs the hosts CPU (tbf, TCP pacing, the veth and
                                the bridge) on the cores that also train: β, seconds per byte, fitted
    T_wire  = F·x_q / B         the push goes up, its reply comes down, one after the other; F =
                                1514 / 1448: what tbf meters per byte of payload, each 1448-byte TCP
                                segment (MTU 1500, timestamps on) carrying 66 bytes of Ethernet, IPv4
                                and TCP headers (the messages' own fields, ~0.3 kB an exchange, are
                                not counted)
    stream  T = mean_q max(T_cpu, T_wire)   an exchange travels while the next one computes
                                            (staleness 1): the slower of the two sets its pace
    jobs    T = T0 + (β + F/B)·x             a sync round waits for its results and the next broadcast
    images/s = N·H·b / T

A stream cell that carries its exchanges in time order (``exchange_slices``: 20 consecutive
slices of the run, each slice's mean bytes x_q, a block's period c_q per exchange and the
driver's time s_q on a push, all from the unshaped cell) is modelled as a round trip against
the next exchange's compute, with what the run spends outside its exchanges kept as it was::

    n       = exchanges per block;  fixed = train wall − n · mean_q c_q   (start, stage ends, tests)
    T_q     = max(c_q + β·x_q,  s_q + F·x_q / B)    the reply to a push must be back before the
                                                    next exchange is computed: the server's time
                                                    on it, then the wire both ways
    wall    = fixed + n · mean_q T_q;   images/s = unshaped images/s · unshaped train wall / wall

The server's time matters where the link's time alone would hide behind the compute: in the
warm-up a push of ~50 k entries keeps the driver ~8 ms, its ~0.3 MB take ~25 ms at 100 Mbit/s,
and a step ~20 ms. The time the run spends outside its exchanges (the epoch's evaluation, the
stage's start and end) is a fifth of a short cell's wall; its own transfers are not modelled.

β >= 0 is the one fitted constant: least squares on log images/s over the 1 Gbit/s cells (the
unshaped cells give T0 and x, and fit nothing). The link's rate is not scaled by a fitted
efficiency: B is the rate tbf enforces. ``bound`` names the term that sets T.

Target: every held-out cell's prediction within 25 % of its measured images/s
(``|predicted / measured - 1| <= 0.25``). Output: one JSON object (``cells``: each cell's
role, measured and predicted images/s, error and bound; ``fit``; ``links``: the run it read;
``passed``). Exit 0 when the target holds, 1 otherwise, 2 on bad arguments or input.

    python bench/linkmodel.py [--train-rows 12000] [--epochs 1] [--reps 3] [--gate 0.6] [--links FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit, exit_status  # noqa: E402

# bytes on a shaped link per byte of payload: a 1448-byte TCP segment (MTU 1500 less 20 bytes of
# IPv4 and 32 of TCP with timestamps) goes out as a 1514-byte frame with its Ethernet header
WIRE_FACTOR = 1514 / 1448
FIT_RATES = ("unshaped", "1gbit")
HELD_OUT = ("100mbit", "20mbit")
TARGET = 0.25


class BadLinks(ValueError):
    """A links run the model cannot read."""


def rate_bytes_per_s(rate: str) -> float:
    """A rate as ``bench/links.py`` names it (``100mbit``, ``1gbit``) in bytes/s."""
    from sparkcnn.testing.testbed import parse_rate

    return parse_rate(rate) / 8


def cell_inputs(cell: dict, where: str) -> dict:
    """What the model takes from one cell: images per exchange round (N·H·b) and the bytes of one
    block's exchange. A stream record is one block's push; a jobs sync record a round of N blocks."""
    need = ("images_per_s", "bytes_up_per_step", "bytes_down_per_step", "blocks", "batch_size", "steps_per_round",
            "transport")
    missing = [k for k in need if not isinstance(cell.get(k), (int, float, str)) or cell.get(k) is None]
    if missing:
        raise BadLinks(f"{where}: field {missing[0]!r} missing (a links run from before the cells carried it?)")
    n, h, b = int(cell["blocks"]), int(cell["steps_per_round"]), int(cell["batch_size"])
    per_step = float(cell["bytes_up_per_step"]) + float(cell["bytes_down_per_step"])
    stream = cell["transport"] == "stream"
    # per local step of the records: a stream record is one block's exchange of H steps; a sync
    # round record counts H steps for all N blocks, each block moving its own share over its link
    x = per_step * h if stream else per_step * h / n
    spread = [float(q) for q in cell.get("bytes_per_exchange_quantiles") or () if isinstance(q, (int, float))]
    out = {"images": n * h * b, "bytes": x, "stream": stream, "spread": spread or [x]}
    sl = cell.get("exchange_slices") or {}
    if stream and sl:
        parts = [sl.get(k) for k in ("bytes", "period_s", "server_s")]
        if (not all(isinstance(p, list) and p and len(p) == len(parts[0]) for p in parts)
                or not all(isinstance(v, (int, float)) and v >= 0 for p in parts for v in p)):
            raise BadLinks(f"{where}: 'exchange_slices' needs three equal lists of numbers >= 0 "
                           f"(bytes, period_s, server_s)")
        for k in ("train_wall_s", "steps"):
            if not isinstance(cell.get(k), (int, float)) or cell[k] <= 0:
                raise BadLinks(f"{where}: field {k!r} missing or not > 0 (needed with 'exchange_slices')")
        out["slices"] = list(zip(*(map(float, p) for p in parts)))
        out["wall"] = float(cell["train_wall_s"])
        out["exchanges"] = float(cell["steps"]) / (n * h)  # per block
    return out


def predict(base: dict, beta: float, rate: str) -> tuple[float, str]:
    """(images/s, bound) of a variant at ``rate`` from its unshaped cell's inputs ``base``."""
    t0 = base["images"] / base["images_per_s"]
    if rate == "unshaped":
        return base["images_per_s"], "cpu"
    rate_b = rate_bytes_per_s(rate) / WIRE_FACTOR  # payload bytes per second
    if not base["stream"]:
        return base["images"] / (t0 + (beta + 1 / rate_b) * base["bytes"]), "cpu + wire"
    if "slices" in base:
        return _predict_round_trips(base, beta, rate_b)
    # the slices' times, each the slower of its CPU and its wire time
    t, bound = _paced([(t0 + beta * x, x / rate_b) for x in base["spread"]])
    return base["images"] / t, bound


def _paced(slices: list[tuple[float, float]]) -> tuple[float, str]:
    """(mean time, bound) of slices given as (CPU time, wire time): each takes the slower of the
    two; the bound names the one that set the pace, or in how many slices the wire did."""
    wire = sum(w > c for c, w in slices)
    bound = "wire" if wire == len(slices) else "cpu" if not wire else f"wire in {wire} of {len(slices)} slices"
    return sum(max(c, w) for c, w in slices) / len(slices), bound


def _predict_round_trips(base: dict, beta: float, rate_b: float) -> tuple[float, str]:
    """A stream cell with its exchanges in time order (module docstring): each slice paced by the
    slower of its compute and its round trip, the run's time outside the exchanges kept."""
    n, slices = base["exchanges"], base["slices"]
    fixed = max(0.0, base["wall"] - n * sum(c for _, c, _ in slices) / len(slices))
    t, bound = _paced([(c + beta * x, s + x / rate_b) for x, c, s in slices])
    return base["images_per_s"] * base["wall"] / (fixed + n * t), bound


def fit_beta(bases: dict, fit_cells: list[tuple[str, str, float]]) -> float:
    """β >= 0 minimising the squared log error of the fit cells' images/s (one dimension: a scan of
    a log grid, then golden-section refinement around its best point)."""
    def loss(beta: float) -> float:
        return sum((math.log(predict(bases[v], beta, r)[0]) - math.log(m)) ** 2 for r, v, m in fit_cells)

    grid = [0.0] + [10 ** (e / 8) for e in range(-14 * 8, -4 * 8)]  # 1e-14 .. 1e-4 s per byte
    i = min(range(len(grid)), key=lambda j: loss(grid[j]))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    g = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if loss(a) <= loss(b) else (a, hi)
    best = (lo + hi) / 2
    return best if loss(best) <= loss(grid[i]) else grid[i]


def validate(links: dict) -> dict:
    """Fit on ``FIT_RATES``, predict ``HELD_OUT``: the cells, the fit and whether the target holds."""
    rates = links.get("rates")
    if not isinstance(rates, dict):
        raise BadLinks("no 'rates' object: not a bench/links.py result")
    absent = [r for r in (*FIT_RATES, *HELD_OUT) if not isinstance(rates.get(r), dict) or not rates[r]]
    if absent:
        raise BadLinks(f"rate {absent[0]!r} not measured (need {', '.join((*FIT_RATES, *HELD_OUT))})")
    bases = {}
    for v, cell in rates["unshaped"].items():
        bases[v] = {**cell_inputs(cell, f"unshaped/{v}"), "images_per_s": float(cell["images_per_s"])}
    fit_cells, held = [], []
    for r in (*FIT_RATES, *HELD_OUT):
        for v, cell in rates[r].items():
            if v not in bases:
                raise BadLinks(f"{r}/{v}: no unshaped cell of that variant")
            m = cell.get("images_per_s")
            if not isinstance(m, (int, float)) or m <= 0:
                raise BadLinks(f"{r}/{v}: images_per_s {m!r}")
            (fit_cells if r in FIT_RATES else held).append((r, v, float(m)))
    beta = fit_beta(bases, [c for c in fit_cells if c[0] != "unshaped"])
    cells = []
    for role, group in (("fit", fit_cells), ("held out", held)):
        for r, v, m in group:
            p, bound = predict(bases[v], beta, r)
            cells.append({"rate": r, "variant": v, "role": role, "measured_images_per_s": m,
                          "predicted_images_per_s": p, "error": p / m - 1, "bound": bound,
                          "bytes_per_exchange": bases[v]["bytes"],
                          "test_accuracy": rates[r][v].get("test_accuracy")})
    worst = max(abs(c["error"]) for c in cells if c["role"] == "held out")
    trained = all(c["passed"] for k, c in (links.get("checks") or {}).items() if k.endswith("_trained"))
    return {"cells": cells, "fit": {"beta_ns_per_byte": beta * 1e9, "fitted_on": list(FIT_RATES),
                                    "held_out": list(HELD_OUT)},
            "max_abs_held_out_error": worst, "target": TARGET, "all_cells_trained": trained,
            "passed": worst <= TARGET and trained}


def measure(args) -> dict:
    """One bench/links.py run at every rate the model needs (its JSON)."""
    from bench import links

    with tempfile.TemporaryDirectory(prefix="sparkcnn-linkmodel-") as tmp:
        out = os.path.join(tmp, "links.json")
        argv = ["--rates", ",".join((*FIT_RATES, *HELD_OUT)), "--epochs", str(args.epochs), "--gate", str(args.gate),
                "--train-rows", str(args.train_rows), "--reps", str(args.reps), "--out", out]
        with contextlib.redirect_stdout(sys.stderr):  # its JSON goes to the file: this prints one object
            code = links.main(argv)
        if code == 2 or not os.path.exists(out):
            raise BadLinks(f"bench/links.py {' '.join(argv[:-2])} exited {code}")
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", help="read this bench/links.py result instead of running one")
    p.add_argument("--train-rows", type=int, default=12000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="repetitions per cell (their medians are modelled)")
    p.add_argument("--gate", type=float, default=0.6, help="accuracy a cell must reach for its speed to count")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    try:
        if args.links:
            try:
                with open(args.links, encoding="utf-8") as fh:
                    links = json.load(fh)
            except (OSError, ValueError) as e:
                raise BadLinks(f"{args.links}: {e}") from None
        else:
            if args.train_rows < 1000 or args.epochs < 1 or args.reps < 1:
                raise BadLinks(f"--train-rows must be >= 1000, --epochs and --reps >= 1, got {args.train_rows}, "
                               f"{args.epochs}, {args.reps}")
            links = measure(args)
        out = validate(links)
    except BadLinks as e:
        print(f"linkmodel: {e}", file=sys.stderr)
        return 2
    emit({**out, "links": {k: v for k, v in links.items() if k != "provenance"},
          "links_provenance": links.get("provenance")}, args.out)
    return exit_status("linkmodel")


if __name__ == "__main__":
    sys.exit(main())
