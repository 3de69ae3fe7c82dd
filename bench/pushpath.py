"""The path of one stream push through the driver's code: the sparkcnn modules it passes, in order.

Trains a short in-process stream run (async, one step per exchange, sparse both ways) of
a checkout's ``sparkcnn`` (``--base REV``, in a temporary ``git worktree``, and this working tree
as the head; each in a child process of its own), with a profile hook on the parameter-server
service's threads. The
calls and returns between the service receiving push ``--push`` and sending its reply give the
sequence of sparkcnn modules that push runs through (consecutive repeats merged), twice:
``engine``, the modules of the layers that carry the push and apply the rules (``engine/``
before the rebuild; ``server/`` and ``transport/`` after), and ``all``, every sparkcnn module
(the codec, ``ps`` and the other pure modules too). For each:

- ``path``: the modules in order; ``modules``: how many distinct ones;
- ``returns``: how often the path comes back to a module it had left before (the fewer, the
  more each module's part of the work is done in one visit).

Prints one JSON object with both paths. No target: the figure is read before and after a change.

    python bench/pushpath.py [--base REV] [--push 20] [--out FILE]
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
ap.add_argument("--base", default="da6e4ea", help="the revision measured as the base")
ap.add_argument("--tree", help=argparse.SUPPRESS)  # the child: the checkout whose sparkcnn/ it measures
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


DECODE = "<decode>"  # the mark a call of streamwire.decode leaves in a thread's events


class Tracer:
    """Records, per thread, the sparkcnn module executing after every call and return, and
    :data:`DECODE` where a message's decoding begins."""

    def __init__(self):
        self.events: dict[int, list[str]] = {}

    def __call__(self, frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name == "sparkcnn.streamwire" and frame.f_code.co_name == "decode":
                self.events.setdefault(threading.get_ident(), []).append(DECODE)
        elif event == "return" and frame.f_back is not None:
            name = frame.f_back.f_globals.get("__name__", "")
        else:
            return
        if name.startswith("sparkcnn"):
            self.events.setdefault(threading.get_ident(), []).append(name)


def pushes(events: list[str]) -> list[list[str]]:
    """Split one service thread's events at each message it decodes (a push begins there, and
    runs to the next: its reply's encoding and writing included). Split at the call of
    ``decode`` itself: the reply's ``encode`` is in the same module, and on a socket wire
    nothing else lies between the two."""
    out: list[list[str]] = []
    for m in events:
        if m == DECODE:
            out.append([])
        elif out:
            out[-1].append(m)
    return out


def main(argv=None) -> int:
    a = ap.parse_args(argv)
    if a.tree:
        return measure(a.tree, a.push)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from bench._common import emit

    def child(tree: str) -> dict:
        got = subprocess.run([sys.executable, os.path.abspath(__file__), "--tree", tree, "--push", str(a.push)],
                             capture_output=True, text=True, cwd=tree)
        if got.returncode != 0:
            raise SystemExit(f"pushpath: the run in {os.path.basename(tree)} failed: {got.stderr[-2000:]}")
        return json.loads(got.stdout)

    with tempfile.TemporaryDirectory(prefix="sparkcnn-pushpath-base-") as tmp:
        base_dir = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", root, "worktree", "add", "--detach", base_dir, a.base], check=True,
                       capture_output=True)
        try:
            base = child(base_dir)
        finally:
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", base_dir], capture_output=True)
    head = child(root)
    emit({"bench": "pushpath", "push": a.push, "base": base, "head": head}, a.out)
    return 0


def measure(tree: str, push: int) -> int:
    """In a child: trace ``push`` of a short stream run of ``tree``'s sparkcnn; print its paths."""
    sys.path.insert(0, os.path.abspath(tree))
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
        raw = make_fake_fashion(os.path.join(tmp, "raw"), 1200, 200, seed=3)
        prepare("idx", raw, os.path.join(tmp, "data"))
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
    if len(served) <= push:
        raise SystemExit(f"pushpath: {len(served)} pushes traced, fewer than --push {push} + 1")
    tree = os.path.dirname(os.path.dirname(os.path.abspath(sparkcnn.__file__)))
    commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", tree, "status", "--porcelain", "sparkcnn"], capture_output=True,
                                text=True).stdout.strip())
    one = served[push]
    engine = [m for m in one if m.startswith(ENGINE_LAYERS)]
    print(json.dumps({"commit": commit, "dirty": dirty, "pushes_traced": len(served), "rounds": summary["rounds"],
                      "engine": module_path(engine), "all": module_path(one)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
