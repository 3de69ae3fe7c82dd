"""Shared fixtures: one local[2] SparkSession for the whole run, tiny prepared datasets,
a standalone cluster, ``make dist``'s packages."""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def spark():
    from sparkcnn.backends.session import get_or_create_spark

    session = get_or_create_spark("local[2]", app_name="sparkcnn-tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A learnable Fashion-MNIST look-alike (IDX .gz → prepared Parquet): 1200 train, 400 test."""
    from sparkcnn.data.prepare import prepare
    from sparkcnn.data.synthetic import make_fake_fashion

    root = tmp_path_factory.mktemp("tiny")
    raw = make_fake_fashion(str(root / "raw"), 1200, 400, seed=3)
    out = str(root / "prepared")
    prepare("idx", raw, out)
    return out


@pytest.fixture()
def tiny_cfg(tiny_data, tmp_path):
    from sparkcnn import config

    return config.load(None, [f"data.path={tiny_data}", f"run.out_dir={tmp_path / 'runs'}", "train.epochs=2",
                              "train.batch_size=32", "train.steps_per_round=5", "train.lr=0.05",
                              "train.lr_warmup_epochs=0", "train.lr_schedule=constant"])


@pytest.fixture(scope="session")
def standalone_cluster():
    """A standalone master and 2 workers of 1 core on 127.0.0.1, shared by the cluster tests
    that leave it intact (tests that kill workers start their own). One SparkContext per
    process: drive it from a subprocess (``spark-submit``, or ``session`` after ``attach``)."""
    from sparkcnn.testing.standalone import StandaloneCluster

    with StandaloneCluster(workers=2, cores_per_worker=1).start(timeout=180) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def executor_python(tmp_path_factory):
    """An interpreter with sparkcnn's dependencies but not sparkcnn (``tests/cluster_env.py``)."""
    from tests.cluster_env import deps_only_python

    return deps_only_python(str(tmp_path_factory.mktemp("deps-only-venv")))


@pytest.fixture(scope="session")
def dist(tmp_path_factory) -> str:
    """``make dist`` into a temporary directory (the working tree's dist/ stays as it is)."""
    from tests.cluster_env import REPO

    out = str(tmp_path_factory.mktemp("dist") / "dist")
    # build with this interpreter, and never install into its environment from a test: VENV names
    # it, so the Makefile's stamp is the very file -o marks as up to date (a relative stamp from a
    # second worktree would not match, and make would reinstall that environment from this tree)
    venv = os.path.dirname(os.path.dirname(sys.executable))
    proc = subprocess.run(["make", "-s", "-o", os.path.join(venv, ".installed"), "dist", f"VENV={venv}",
                           f"PY={sys.executable}", f"DIST={out}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out
