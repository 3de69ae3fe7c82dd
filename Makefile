# sparkcnn: `make train` (set up, prepare Fashion-MNIST, train 3 epochs, report), `make test`,
# `make test-unit` (tests/unit alone: no Spark, no TensorFlow; under a minute) and
# `make test-packaging` (route (b) and the image's entrypoint run for real; minutes, so apart).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
FMNIST_SRC ?= /usr/share/datasets/fashion-mnist
DATA   ?= data/fashion-mnist
# CIFAR-10 as an archive of JPEG/PNG files in train/<class>/ and test/<class>/ (the default: a copy
# beside the project, when there is one); the official archives are prepared with --format
# cifar10-py or cifar10-bin instead
CIFAR10_JPEG    := ../shared/data/cifar10-jpeg.tar.gz
CIFAR10_ARCHIVE ?= $(wildcard $(CIFAR10_JPEG))
CIFAR10_DATA    ?= data/cifar10
# sha256 of that copy: checked when the archive is that file; other archives are taken as given
CIFAR10_JPEG_SHA256 := c66dd055920770913e1e33b948d662b700fc24a9d97d719b05f67f9a7624b42f
DIST   ?= dist
STAMP  := $(VENV)/.installed
# the DAG's SparkSubmitOperator; without its pyspark-client requirement (see pyproject's airflow extra)
AIRFLOW_SPARK_PROVIDER ?= apache-airflow-providers-apache-spark>=6,<7

.PHONY: setup dataset-package data data-cifar10 train test test-unit test-packaging bench dist clean

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

# CIFAR-10 from an archive of image folders: unpacked into a temporary directory (removed after),
# prepared into $(CIFAR10_DATA) by one Spark pass (conf/cifar10_resnet20.yaml reads it)
data-cifar10: $(STAMP)
	@test -n "$(CIFAR10_ARCHIVE)" || { echo "sparkcnn: no CIFAR-10 archive: make data-cifar10 CIFAR10_ARCHIVE=<.tar.gz of train/<class>/ and test/<class>/ images>, or unpack the official archive and run sparkcnn prepare --format cifar10-py (or cifar10-bin) --source <dir> --out $(CIFAR10_DATA)"; exit 2; }
	@test -f "$(CIFAR10_ARCHIVE)" || { echo "sparkcnn: $(CIFAR10_ARCHIVE): no such archive"; exit 2; }
	@if [ "$(CIFAR10_ARCHIVE)" = "$(CIFAR10_JPEG)" ]; then \
	  echo "$(CIFAR10_JPEG_SHA256)  $(CIFAR10_ARCHIVE)" | sha256sum -c --quiet - \
	    || { echo "sparkcnn: $(CIFAR10_ARCHIVE): sha256 differs from the known copy's"; exit 2; }; fi
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  tar -xzf "$(CIFAR10_ARCHIVE)" -C "$$tmp" && \
	  src=$$tmp && if [ ! -d "$$src/train" ] && [ $$(ls "$$tmp" | wc -l) = 1 ]; then src=$$tmp/$$(ls "$$tmp"); fi && \
	  $(PY) -m sparkcnn prepare --format images --source "$$src" --out $(CIFAR10_DATA) > /dev/null && \
	  echo "sparkcnn: CIFAR-10 prepared in $(CIFAR10_DATA)"

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
