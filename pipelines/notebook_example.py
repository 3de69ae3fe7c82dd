"""Notebook usage (Databricks style): the SparkSession already exists; sparkcnn uses it.

Run cell by cell. Executors need the sparkcnn package installed (cluster library).
"""

# %% configure: start from the shipped config, override what differs on this cluster
from sparkcnn import config
from sparkcnn.train import train
from sparkcnn.metrics import ProgressBar

cfg = config.load("conf/fashion_mnist.yaml", [
    "data.path=/dbfs/datasets/fashion-mnist",   # prepared with `sparkcnn prepare`
    "run.out_dir=/dbfs/sparkcnn/runs",
    "data.num_blocks=8",                        # one block per executor core
    "compression.method=threshold",
    "compression.density=0.001",
])

# %% train: uses SparkSession.getActiveSession(); jobs show up as "sparkcnn <run> epoch E round R"
summary = train(cfg, progress=ProgressBar())
print(summary["test_accuracy"], summary["run_dir"])

# %% look at the run: report.png holds loss, accuracy, throughput and bytes per round
from IPython.display import Image  # noqa: E402

Image(filename=f"{summary['run_dir']}/report.png")
