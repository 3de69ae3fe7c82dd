"""No shared path: the Estimator trains on a cluster from an in-memory DataFrame while the
executors' Python workers refuse to open any data file outside Spark's own directories."""

import json
import os
import subprocess
import sys

import pytest

from tests.cluster_env import audit_conf, audit_installs, clean_env, refused_opens

pytestmark = pytest.mark.cluster

CLIENT = r"""
import json, os, sys
import numpy as np
from sparkcnn.data.parquet_io import read_split_numpy
from sparkcnn.testing.standalone import FAST_START_JAVA_OPTS, StandaloneCluster, session
from sparkcnn.ml import SparkCNNClassifier

data, out_dir, conf = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cluster = StandaloneCluster.attach(os.environ["SPARKCNN_CLUSTER"])
spark = session(cluster, "no-shared-path", conf={"spark.executor.extraJavaOptions": FAST_START_JAVA_OPTS,
                                                 "spark.task.maxFailures": "1", **conf})
x, y = read_split_numpy(os.path.join(data, "train"))  # the driver's own memory: no path reaches the executors
df = spark.createDataFrame([(bytearray(a.tobytes()), int(b)) for a, b in zip(x, y)], "image binary, label int")
clf = SparkCNNClassifier(epochs=2, batchSize=32, stepsPerRound=5, lr=0.05, lrWarmupEpochs=0.0,
                         lrSchedule="constant", numBlocks=2, imageShape=[28, 28, 1], outDir=out_dir)
model = clf.fit(df)
rows = model.transform(df.limit(300)).select("prediction", "label").collect()
summary = json.load(open(os.path.join(model.getRunDir(), "summary.json")))
spark.stop()
print(json.dumps({"accuracy": float(np.mean([r[0] == r[1] for r in rows])), "master": summary["master"],
                  "executors": summary["executors"], "executor_tasks": summary["executor_tasks"],
                  "train_rows": summary["train_rows"]}))
"""


def test_estimator_trains_from_memory_with_data_opens_refused(standalone_cluster, tiny_data, tmp_path):
    log = tmp_path / "audit.log"
    env = clean_env(SPARKCNN_CLUSTER=standalone_cluster.to_json(), PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, "-c", CLIENT, tiny_data, str(tmp_path / "runs"),
                           json.dumps(audit_conf(log))], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["master"] == standalone_cluster.master_url and out["train_rows"] == 1200
    assert len(out["executors"]) == 2 and all(n > 0 for n in out["executor_tasks"].values())  # both trained
    assert out["accuracy"] > 0.6
    assert refused_opens(log) == []  # no data file was opened from a path on the executors ...
    assert len(audit_installs(log)) >= 2  # ... and the hook ran in the executors' workers
    assert os.path.isfile(os.path.join(tmp_path, "runs", os.listdir(tmp_path / "runs")[0], "model.keras"))
