"""The path of one stream push through the driver's code: the sparkcnn modules it passes, in order.

Trains a short in-process stream run (async, one step per exchange, sparse both ways) of
whichever ``sparkcnn`` is first on ``sys.path`` (``--tree DIR`` puts a checkout's first, so two
trees can be compared), with a profile hook on the parameter-server service's threads. The
calls and returns between the service receiving push ``--push`` and sending its reply give the
sequence of sparkcnn modules that push runs through (consecutive repeats merged), twice:
``engine``, the modules of the layers that carry the push and apply the rules (``engine/``
before the rebuild; ``server/`` and ``transport/`` after), and ``all``, every sparkcnn module
(the codec, ``ps`` and the other pure modules too). For each:

- ``path``: the modules in order; ``modules``: how many distinct ones;
- ``returns``: how often the path comes back to a module it had left before (the fewer, the
  more each module's part of the work is done in one visit).

Prints one JSON object. No target: the figure is read before and after a change.

    python bench/pushpath.py [--tree DIR] [--push 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--tree", help="a checkout whose sparkcnn/ is measured (default: this one)")
ap.add_argument("--push", type=int, default=20, help="which push of the run to trace (0-based)")
ap.add_argument("--out", help="also write the JSON here")


# the layers that carry a push and apply the run's rules (before the rebuild: engine/); the pure
# modules they call (ps, compression, protocol, guard, ...) are left out of the "engine" path
ENGINE_LAYERS = ("sparkcnn.engine", "sparkcnn.server", "sparkcnn.transport")


def module_path(events: list[str]) -> dict:
    """Merge consecutive repeats; count the visits to a module left before."""
    path: list[str] = []
    for m in events:
        if not path or path[-1] != m:
            path.append(m)
    seen, returns = set(), 0
    for m in path:
        returns += m in seen
        seen.add(m)
    return {"path": path, "modules": len(seen), "steps": len(path), "returns": returns}


class Tracer:
    """Records, per thread, the sparkcnn module executing after every call and return."""

    def __init__(self):
        self.events: dict[int, list[str]] = {}

    def __call__(self, frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
        elif event == "return" and frame.f_back is not None:
            name = frame.f_back.f_globals.get("__name__", "")
        else:
            return
        if name.startswith("sparkcnn"):
            self.events.setdefault(threading.get_ident(), []).append(name)


def pushes(events: list[str]) -> list[list[str]]:
    """Split one service thread's events at each message it decodes (a push begins there)."""
    out: list[list[str]] = []
    for i, m in enumerate(events):
        if m == "sparkcnn.streamwire" and (i == 0 or events[i - 1] != m):
            out.append([])
        if out:
            out[-1].append(m)
    return out


def main(argv=None) -> int:
    a = ap.parse_args(argv)
    if a.tree:
        sys.path.insert(0, os.path.abspath(a.tree))
    import sparkcnn
    from sparkcnn import config
    from sparkcnn.data.prepare import prepare
    from sparkcnn.data.synthetic import make_fake_fashion
    from sparkcnn.train import train

    # the parameter-server service, wherever the tree keeps it (not by ImportError: an editable
    # install's finder would find this checkout's module under another tree's package)
    if os.path.isdir(os.path.join(os.path.dirname(sparkcnn.__file__), "transport")):
        from sparkcnn.transport.service import PSService
    else:
        from sparkcnn.engine.psservice import PSService

    tracer = Tracer()
    serve = PSService.serve_stream

    def traced(self, *args):  # gRPC's threads are not Python's: each installs the hook itself
        sys.setprofile(tracer)
        try:
            return serve(self, *args)
        finally:
            sys.setprofile(None)

    PSService.serve_stream = traced
    with tempfile.TemporaryDirectory(prefix="sparkcnn-pushpath-") as tmp:
        prepare("idx", make_fake_fashion(os.path.join(tmp, "raw"), 1200, 200, seed=3), os.path.join(tmp, "data"))
        cfg = config.load(None, [f"data.path={os.path.join(tmp, 'data')}", f"run.out_dir={tmp}/runs",
                                 "engine.master=inprocess", "engine.transport=stream", "engine.mode=async",
                                 "train.epochs=1", "train.batch_size=32", "train.steps_per_round=1",
                                 "compression.method=threshold", "compression.density=0.01",
                                 "compression.density_down=0.01", "checkpoint.every_rounds=0"])
        try:
            summary = train(cfg)
        finally:
            PSService.serve_stream = serve
    # the service threads are those that decoded messages
    served = [p for ev in tracer.events.values() for p in pushes(ev)]
    served = [p for p in served if "sparkcnn.streamwire" in p and len(module_path(p)["path"]) > 3]
    if len(served) <= a.push:
        raise SystemExit(f"pushpath: {len(served)} pushes traced, fewer than --push {a.push} + 1")
    tree = os.path.dirname(os.path.dirname(os.path.abspath(sparkcnn.__file__)))
    commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", tree, "status", "--porcelain", "sparkcnn"], capture_output=True,
                                text=True).stdout.strip())
    one = served[a.push]
    engine = [m for m in one if m.startswith(ENGINE_LAYERS)]
    out = {"bench": "pushpath", "commit": commit, "dirty": dirty,
           "push": a.push, "pushes_traced": len(served), "rounds": summary["rounds"],
           "engine": module_path(engine), "all": module_path(one)}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
