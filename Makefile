# sparkcnn: `make train` (set up, prepare Fashion-MNIST, train 3 epochs, report), `make test`,
# `make test-unit` (tests/unit alone: no Spark, no TensorFlow; under a minute) and
# `make test-packaging` (route (b) and the image's entrypoint run for real; minutes, so apart).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
FMNIST_SRC ?= /usr/share/datasets/fashion-mnist
DATA   ?= data/fashion-mnist
DIST   ?= dist
STAMP  := $(VENV)/.installed
# the DAG's SparkSubmitOperator; without its pyspark-client requirement (see pyproject's airflow extra)
AIRFLOW_SPARK_PROVIDER ?= apache-airflow-providers-apache-spark>=6,<7

.PHONY: setup dataset-package data train test test-unit test-packaging bench dist clean

$(STAMP): pyproject.toml
	@command -v java >/dev/null || { echo "sparkcnn: Java 17+ is required by Spark (apt-get install openjdk-17-jre-headless)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,viz,mlflow,airflow]"
	$(PY) -m pip install -q --no-deps "$(AIRFLOW_SPARK_PROVIDER)"
	touch $(STAMP)

setup: $(STAMP)

# Fashion-MNIST ships as the Debian package dataset-fashion-mnist
dataset-package:
	@if [ ! -f $(FMNIST_SRC)/train-images-idx3-ubyte.gz ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    (apt-get install -y -q dataset-fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) >/dev/null; \
	  else echo "sparkcnn: install the Debian package dataset-fashion-mnist (or set FMNIST_SRC)"; exit 1; fi; fi

data: $(STAMP) dataset-package
	@test -d $(DATA)/test || $(VENV)/bin/sparkcnn prepare --format idx --source $(FMNIST_SRC) --out $(DATA)

train: $(STAMP) data
	$(VENV)/bin/sparkcnn train --config conf/fashion_mnist.yaml

test: $(STAMP) dataset-package
	$(PY) -m pytest -q -p no:cacheprovider -m "not packaging" --durations=30 tests

# the unit tier alone (tests/unit: numpy, pyarrow and the standard library; no Spark session,
# no TensorFlow): the quick check while editing
test-unit: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

# the tests marked packaging: a venv-pack archive of the wheel shipped with --archives to a
# standalone cluster (route (b); pip reaches PyPI), and the entrypoint's driver and executor
test-packaging: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m packaging --durations=5 tests

bench: $(STAMP) data
	$(PY) bench/blocks.py
	$(PY) bench/throughput.py --quick

# spark-submit packaging: the wheel (for pip, or a venv-pack archive: --archives) and a
# --py-files zip holding the sparkcnn package alone (for executors that have its dependencies)
dist: $(STAMP)
	rm -rf $(DIST) build && mkdir -p $(DIST)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(DIST) .
	$(PY) -c 'import sys, zipfile; whl = zipfile.ZipFile(sys.argv[1]); out = zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED); [out.writestr(i, whl.read(i)) for i in whl.infolist() if i.filename.startswith("sparkcnn/")]; out.close()' $(DIST)/sparkcnn-*.whl $(DIST)/sparkcnn.zip

clean:
	rm -rf $(VENV) data runs $(DIST) build
