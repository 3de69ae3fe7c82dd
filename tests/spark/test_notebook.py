"""pipelines/sparkcnn_quickstart.ipynb runs headless (nbclient + ipykernel) on a small prepared dataset."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "pipelines", "sparkcnn_quickstart.ipynb")


def _text(cell) -> str:
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                   for o in cell.get("outputs", []))


@pytest.mark.slow
def test_quickstart_notebook_runs_headless(tiny_data, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])], "no parameters cell"
    # the kernel inherits this environment: the parameters cell reads it
    monkeypatch.setenv("SPARKCNN_DATA", tiny_data)
    monkeypatch.setenv("SPARKCNN_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("SPARKCNN_TRAIN_ROWS", "1200")
    monkeypatch.setenv("SPARKCNN_EPOCHS", "1")
    # settings of the user's own (the notebook keeps them): no UI, no console bars, loopback only
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--conf spark.ui.enabled=false "
                       "--conf spark.ui.showConsoleProgress=false pyspark-shell")
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)  # the notebook must pick its workers' Python itself
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failure

    out = {c.id: _text(c) for c in nb.cells if c.cell_type == "code"}
    m = re.search(r"test accuracy: ([0-9.]+)", out["accuracy"])
    assert m and 0.3 < float(m.group(1)) <= 1.0, out["accuracy"]  # 10 learnable classes: chance is 0.1
    assert "prediction" in out["transform"] and "probability" in out["transform"]
    runs = os.listdir(tmp_path / "runs")
    assert len(runs) == 1 and os.path.isfile(tmp_path / "runs" / runs[0] / "model.keras")
    plot = next(c for c in nb.cells if c.id == "plot")
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "no figure from the plot cell"
