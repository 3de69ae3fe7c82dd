"""Spark ML: :class:`SparkCNNClassifier` (an Estimator) and :class:`SparkCNNModel` (its Transformer).

They read like Spark's own classifiers: the shared column Params
(``featuresCol`` is the image column), ``@keyword_only`` constructors,
setters and getters, ``save``/``load``, and they work in a ``Pipeline``, with
``MulticlassClassificationEvaluator`` and in a ``CrossValidator``::

    clf = SparkCNNClassifier(featuresCol="image", labelCol="label", epochs=1, imageShape=[28, 28, 1])
    model = clf.fit(train_df)                      # sparkcnn.fit on the DataFrame
    scored = model.transform(test_df)              # + rawPrediction, probability, prediction

``fit`` trains with :func:`sparkcnn.fit`; the Params map onto config keys
(``epochs`` → ``train.epochs``, ...; :data:`CONFIG_KEYS`). ``transform`` runs
the Arrow UDF of :mod:`sparkcnn.inference` on the executors; the model goes
with it as the bytes of its ``.keras`` file. A saved model is a directory with
the Params in ``metadata/`` (Spark's own format) and ``model.keras`` beside it.

``batchSize`` and ``stepsPerRound`` (H, local steps between exchanges) follow the
data when neither the Param nor ``configFile`` sets them. The batch is the default
halved while an epoch has fewer than :data:`MIN_EPOCH_STEPS` steps per block, down to
:data:`MIN_DATA_BATCH` (:func:`data_batch_size`); then H = min(default, steps // 4),
where steps = (rows // numBlocks) // batchSize is one epoch's steps per block, and at
least 1 (:func:`data_steps_per_round`). 4,000 rows in 2 blocks: batch 64 gives 31
steps, so an epoch would be one exchange of the default H = 50; batch 32 gives 62
steps and H = 15, four exchanges. A value the user set is kept as it is.
"""

from __future__ import annotations

import json
import logging
import os

from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (HasFeaturesCol, HasLabelCol, HasPredictionCol, HasProbabilityCol,
                                     HasRawPredictionCol, HasSeed)
from pyspark.ml.util import (DefaultParamsReadable, DefaultParamsReader, DefaultParamsWritable,
                             DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter)

from sparkcnn.errors import BadInput
from sparkcnn.protocol import steps_per_epoch

log = logging.getLogger(__name__)

MODEL_FILE = "model.keras"

# An unset batchSize is halved while an epoch has fewer steps per block than this. Measured, 3-epoch
# fits on 4,000 Fashion-MNIST rows in 2 blocks (seeds 1, 2, 3, 42; full test set): batch 64, 31 steps
# (H = 7), reached 0.70-0.75; batch 32, 62 steps (H = 15), 0.775-0.788.
MIN_EPOCH_STEPS = 50
MIN_DATA_BATCH = 16  # the smallest batch chosen: below it a Keras step's fixed cost dominates its images

# Param name -> config key. Chaos and engine internals stay out of the Estimator.
CONFIG_KEYS = {
    "modelName": "model.name",
    "epochs": "train.epochs",
    "batchSize": "train.batch_size",
    "lr": "train.lr",
    "lrSchedule": "train.lr_schedule",
    "lrWarmupEpochs": "train.lr_warmup_epochs",
    "momentum": "train.momentum",
    "weightDecay": "train.weight_decay",
    "stepsPerRound": "train.steps_per_round",
    "compression": "compression.method",
    "density": "compression.density",
    "initialDensity": "compression.initial_density",
    "densityWarmupEpochs": "compression.warmup_epochs",
    "densityDown": "compression.density_down",
    "initialDensityDown": "compression.initial_density_down",
    "compressionMomentum": "compression.momentum",
    "engineMode": "engine.mode",
    "transport": "engine.transport",
    "numBlocks": "data.num_blocks",
    "imageShape": "data.image_shape",
    "classes": "data.classes",
    "outDir": "run.out_dir",
    "seed": "run.seed",
}


class _SparkCNNParams(HasFeaturesCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol):
    """Params the Estimator and the Model share: the columns and the inference batch size."""

    inferenceBatchSize = Param(Params._dummy(), "inferenceBatchSize",
                               "images per model call in transform (bounds executor memory)",
                               typeConverter=TypeConverters.toInt)

    def __init__(self, *args):
        super().__init__(*args)
        self._setDefault(featuresCol="image", inferenceBatchSize=256)

    def getInferenceBatchSize(self) -> int:
        return self.getOrDefault(self.inferenceBatchSize)


class _ClassifierParams(_SparkCNNParams, HasLabelCol, HasSeed):
    """The training Params; each maps onto one config key (:data:`CONFIG_KEYS`)."""

    configFile = Param(Params._dummy(), "configFile",
                       "YAML config the other Params override ('' = built-in defaults)",
                       typeConverter=TypeConverters.toString)
    modelName = Param(Params._dummy(), "modelName",
                      "model builder: fmnist_cnn, resnet20 or package.module:function (model.name)",
                      typeConverter=TypeConverters.toString)
    epochs = Param(Params._dummy(), "epochs", "passes over the training set (train.epochs)",
                   typeConverter=TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", "images per local SGD step per block (train.batch_size); "
                      "unset: the default, halved while an epoch has under 50 steps per block",
                      typeConverter=TypeConverters.toInt)
    lr = Param(Params._dummy(), "lr", "peak learning rate per block (train.lr)",
               typeConverter=TypeConverters.toFloat)
    lrSchedule = Param(Params._dummy(), "lrSchedule", "constant | cosine | step (train.lr_schedule)",
                       typeConverter=TypeConverters.toString)
    lrWarmupEpochs = Param(Params._dummy(), "lrWarmupEpochs", "linear lr warm-up, in epochs (train.lr_warmup_epochs)",
                           typeConverter=TypeConverters.toFloat)
    momentum = Param(Params._dummy(), "momentum", "SGD momentum in [0, 1) (train.momentum)",
                     typeConverter=TypeConverters.toFloat)
    weightDecay = Param(Params._dummy(), "weightDecay", "L2 coefficient (train.weight_decay)",
                        typeConverter=TypeConverters.toFloat)
    stepsPerRound = Param(Params._dummy(), "stepsPerRound",
                          "local steps between exchanges, H (train.steps_per_round); unset: at most a "
                          "quarter of an epoch's steps per block",
                          typeConverter=TypeConverters.toInt)
    compression = Param(Params._dummy(), "compression", "none | threshold | topk (compression.method)",
                        typeConverter=TypeConverters.toString)
    density = Param(Params._dummy(), "density", "target uplink density in (0, 1] (compression.density)",
                    typeConverter=TypeConverters.toFloat)
    initialDensity = Param(Params._dummy(), "initialDensity",
                           "density at the start of the warm-up (compression.initial_density)",
                           typeConverter=TypeConverters.toFloat)
    densityWarmupEpochs = Param(Params._dummy(), "densityWarmupEpochs",
                                "epochs of density warm-up (compression.warmup_epochs)",
                                typeConverter=TypeConverters.toFloat)
    densityDown = Param(Params._dummy(), "densityDown",
                        "downlink density; 0 = dense weights (compression.density_down)",
                        typeConverter=TypeConverters.toFloat)
    initialDensityDown = Param(Params._dummy(), "initialDensityDown",
                               "downlink density at the start of the warm-up; 0 = initialDensity "
                               "(compression.initial_density_down)",
                               typeConverter=TypeConverters.toFloat)
    compressionMomentum = Param(Params._dummy(), "compressionMomentum",
                                "correction | sparsification_aware (compression.momentum)",
                                typeConverter=TypeConverters.toString)
    engineMode = Param(Params._dummy(), "engineMode", "sync | async (engine.mode)",
                       typeConverter=TypeConverters.toString)
    transport = Param(Params._dummy(), "transport",
                      "auto (default: jobs on a classic session, stream on Spark Connect) | jobs (a Spark job "
                      "per exchange; classic sessions) | stream (engine.transport)",
                      typeConverter=TypeConverters.toString)
    numBlocks = Param(Params._dummy(), "numBlocks", "data blocks = Spark partitions (data.num_blocks)",
                      typeConverter=TypeConverters.toInt)
    imageShape = Param(Params._dummy(), "imageShape",
                       "[H, W, C] of binary or array<float> images without shape metadata (data.image_shape)",
                       typeConverter=TypeConverters.toListInt)
    classes = Param(Params._dummy(), "classes", "class names indexed by label (data.classes)",
                    typeConverter=TypeConverters.toListString)
    outDir = Param(Params._dummy(), "outDir", "where run directories go (run.out_dir)",
                   typeConverter=TypeConverters.toString)

    def __init__(self, *args):
        super().__init__(*args)
        self._setDefault(labelCol="label", configFile="")

    def config_overrides(self) -> list[str]:
        """``section.key=value`` strings for every Param set that maps to a config key.

        Values are written as JSON, which YAML reads back with the same type.
        """
        return [f"{key}={json.dumps(self.getOrDefault(name))}" for name, key in CONFIG_KEYS.items()
                if self.isSet(self.getParam(name))]


class SparkCNNClassifier(Estimator, _ClassifierParams, DefaultParamsReadable, DefaultParamsWritable):
    """Trains a CNN with :func:`sparkcnn.fit` on a DataFrame of images and labels.

    Unset training Params keep the values of ``configFile`` (or the built-in
    defaults), but for ``batchSize`` and ``stepsPerRound``, which then follow the
    data (:func:`data_batch_size`, :func:`data_steps_per_round`); ``seed`` applies
    only when set.
    """

    @keyword_only
    def __init__(self, *, featuresCol="image", labelCol="label", predictionCol="prediction",
                 probabilityCol="probability", rawPredictionCol="rawPrediction", configFile="",
                 modelName=None, epochs=None, batchSize=None, lr=None, lrSchedule=None, lrWarmupEpochs=None,
                 momentum=None, weightDecay=None, stepsPerRound=None, compression=None, density=None,
                 initialDensity=None, densityWarmupEpochs=None, densityDown=None, initialDensityDown=None,
                 compressionMomentum=None, engineMode=None, transport=None, numBlocks=None, imageShape=None,
                 classes=None, outDir=None, seed=None, inferenceBatchSize=256):
        super().__init__()
        self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    @keyword_only
    def setParams(self, *, featuresCol="image", labelCol="label", predictionCol="prediction",
                  probabilityCol="probability", rawPredictionCol="rawPrediction", configFile="",
                  modelName=None, epochs=None, batchSize=None, lr=None, lrSchedule=None, lrWarmupEpochs=None,
                  momentum=None, weightDecay=None, stepsPerRound=None, compression=None, density=None,
                  initialDensity=None, densityWarmupEpochs=None, densityDown=None, initialDensityDown=None,
                  compressionMomentum=None, engineMode=None, transport=None, numBlocks=None, imageShape=None,
                  classes=None, outDir=None, seed=None, inferenceBatchSize=256):
        """Set any of the constructor's Params (None leaves one unchanged)."""
        return self._set(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def training_config(self, dataset):
        """The run's Config for ``dataset``: ``configFile``, the Params set, the columns and, for
        what the user left unset, values that follow the data (:func:`data_batch_size`,
        :func:`data_steps_per_round`)."""
        from sparkcnn import config

        image_col, label_col = self.getFeaturesCol(), self.getLabelCol()
        overrides = [*self.config_overrides(), f"data.image_col={json.dumps(image_col)}",
                     f"data.label_col={json.dumps(label_col)}"]
        config_file = self.getOrDefault(self.configFile) or None
        cfg = config.load(config_file, overrides)
        for name in (image_col, label_col):
            if name not in dataset.columns:
                raise BadInput(f"SparkCNNClassifier: column {name!r} not found "
                               f"(columns: {', '.join(dataset.columns) or 'none'})")
        unset = [p for p, key in ((self.batchSize, "batch_size"), (self.stepsPerRound, "steps_per_round"))
                 if not self.isSet(p) and not config.file_sets(config_file, "train", key)]
        rows = dataset.count() if unset else 0
        if self.batchSize in unset:  # first: H follows the batch
            cfg = cfg.replace(train__batch_size=data_batch_size(rows, cfg))
        if self.stepsPerRound in unset:
            cfg = cfg.replace(train__steps_per_round=data_steps_per_round(rows, cfg))
        return cfg

    def _fit(self, dataset) -> "SparkCNNModel":
        import sparkcnn

        cfg = self.training_config(dataset)
        result = sparkcnn.fit(cfg, data=dataset.select(cfg.data.image_col, cfg.data.label_col),
                              spark=dataset.sparkSession, progress=False)
        saved = os.path.join(str(result.run_dir), MODEL_FILE)
        model = SparkCNNModel.from_keras(saved if os.path.isfile(saved) else result.model)
        model._set(runDir=str(result.run_dir or ""))
        return self._copyValues(model)

    # setters and getters, in Spark's style
    def setFeaturesCol(self, value): return self._set(featuresCol=value)
    def setLabelCol(self, value): return self._set(labelCol=value)
    def setPredictionCol(self, value): return self._set(predictionCol=value)
    def setProbabilityCol(self, value): return self._set(probabilityCol=value)
    def setRawPredictionCol(self, value): return self._set(rawPredictionCol=value)
    def setInferenceBatchSize(self, value): return self._set(inferenceBatchSize=value)
    def setConfigFile(self, value): return self._set(configFile=value)
    def setModelName(self, value): return self._set(modelName=value)
    def setEpochs(self, value): return self._set(epochs=value)
    def setBatchSize(self, value): return self._set(batchSize=value)
    def setLr(self, value): return self._set(lr=value)
    def setLrSchedule(self, value): return self._set(lrSchedule=value)
    def setLrWarmupEpochs(self, value): return self._set(lrWarmupEpochs=value)
    def setMomentum(self, value): return self._set(momentum=value)
    def setWeightDecay(self, value): return self._set(weightDecay=value)
    def setStepsPerRound(self, value): return self._set(stepsPerRound=value)
    def setCompression(self, value): return self._set(compression=value)
    def setDensity(self, value): return self._set(density=value)
    def setInitialDensity(self, value): return self._set(initialDensity=value)
    def setDensityWarmupEpochs(self, value): return self._set(densityWarmupEpochs=value)
    def setDensityDown(self, value): return self._set(densityDown=value)
    def setInitialDensityDown(self, value): return self._set(initialDensityDown=value)
    def setCompressionMomentum(self, value): return self._set(compressionMomentum=value)
    def setEngineMode(self, value): return self._set(engineMode=value)
    def setTransport(self, value): return self._set(transport=value)
    def setNumBlocks(self, value): return self._set(numBlocks=value)
    def setImageShape(self, value): return self._set(imageShape=value)
    def setClasses(self, value): return self._set(classes=value)
    def setOutDir(self, value): return self._set(outDir=value)
    def setSeed(self, value): return self._set(seed=value)

    def getConfigFile(self): return self.getOrDefault(self.configFile)
    def getModelName(self): return self.getOrDefault(self.modelName)
    def getEpochs(self): return self.getOrDefault(self.epochs)
    def getBatchSize(self): return self.getOrDefault(self.batchSize)
    def getLr(self): return self.getOrDefault(self.lr)
    def getLrSchedule(self): return self.getOrDefault(self.lrSchedule)
    def getLrWarmupEpochs(self): return self.getOrDefault(self.lrWarmupEpochs)
    def getMomentum(self): return self.getOrDefault(self.momentum)
    def getWeightDecay(self): return self.getOrDefault(self.weightDecay)
    def getStepsPerRound(self): return self.getOrDefault(self.stepsPerRound)
    def getCompression(self): return self.getOrDefault(self.compression)
    def getDensity(self): return self.getOrDefault(self.density)
    def getInitialDensity(self): return self.getOrDefault(self.initialDensity)
    def getDensityWarmupEpochs(self): return self.getOrDefault(self.densityWarmupEpochs)
    def getDensityDown(self): return self.getOrDefault(self.densityDown)
    def getInitialDensityDown(self): return self.getOrDefault(self.initialDensityDown)
    def getCompressionMomentum(self): return self.getOrDefault(self.compressionMomentum)
    def getEngineMode(self): return self.getOrDefault(self.engineMode)
    def getTransport(self): return self.getOrDefault(self.transport)
    def getNumBlocks(self): return self.getOrDefault(self.numBlocks)
    def getImageShape(self): return self.getOrDefault(self.imageShape)
    def getClasses(self): return self.getOrDefault(self.classes)
    def getOutDir(self): return self.getOrDefault(self.outDir)


def data_batch_size(rows: int, cfg) -> int:
    """batchSize for ``rows`` training rows when the user set none: ``cfg``'s (default) batch,
    halved while an epoch has fewer than :data:`MIN_EPOCH_STEPS` steps per block, down to
    :data:`MIN_DATA_BATCH`. Large data keeps the default; on small data a 3-epoch fit is a
    few dozen steps per block, and twice the steps at half the batch learn more."""
    per_block = rows // cfg.data.num_blocks
    batch = cfg.train.batch_size
    while batch // 2 >= MIN_DATA_BATCH and steps_per_epoch(per_block, batch) < MIN_EPOCH_STEPS:
        batch //= 2
    log.info("SparkCNNClassifier: batchSize unset, using %d: %d steps an epoch per block (%d rows in %d blocks); "
             "the default %d is halved while an epoch has under %d, down to %d", batch,
             steps_per_epoch(per_block, batch), rows, cfg.data.num_blocks, cfg.train.batch_size, MIN_EPOCH_STEPS,
             MIN_DATA_BATCH)
    return batch


def data_steps_per_round(rows: int, cfg) -> int:
    """H for ``rows`` training rows when the user set none: ``max(1, min(H0, steps // 4))``.

    ``steps = (rows // data.num_blocks) // train.batch_size`` is one epoch's steps per
    block and ``H0`` is ``cfg``'s (default) value: an epoch then has at least 4 exchanges
    where the data is small, and large data keeps the default's amortisation of each
    exchange's fixed cost.
    """
    per_block = rows // cfg.data.num_blocks
    steps = steps_per_epoch(per_block, cfg.train.batch_size)
    chosen = max(1, min(cfg.train.steps_per_round, steps // 4))
    log.info("SparkCNNClassifier: stepsPerRound unset, using %d: at most a quarter of the %d steps an epoch "
             "takes per block (%d rows in %d blocks, batch %d) and at most the default %d", chosen, steps, rows,
             cfg.data.num_blocks, cfg.train.batch_size, cfg.train.steps_per_round)
    return chosen


class SparkCNNModel(Model, _SparkCNNParams, MLReadable, MLWritable):
    """Adds ``rawPrediction`` (logits), ``probability`` (softmax; both ML dense Vectors) and
    ``prediction`` (argmax, double) to a DataFrame with an image column."""

    runDir = Param(Params._dummy(), "runDir", "run directory of the training run ('' = none)",
                   typeConverter=TypeConverters.toString)

    @keyword_only
    def __init__(self, *, featuresCol="image", predictionCol="prediction", probabilityCol="probability",
                 rawPredictionCol="rawPrediction", inferenceBatchSize=256, runDir=""):
        super().__init__()
        self._setDefault(runDir="")
        self._set(**self._input_kwargs)
        self._keras_bytes: bytes | None = None
        self._input_shape: tuple[int, ...] | None = None
        self._num_classes: int | None = None

    @classmethod
    def from_keras(cls, model, **params) -> "SparkCNNModel":
        """A Transformer for a ``keras.Model``, a ``.keras`` path or ``.keras`` file bytes."""
        from sparkcnn.inference import model_bytes

        out = cls(**params)
        out._set_model_bytes(model_bytes(model))
        return out

    def _set_model_bytes(self, data: bytes, name: str = "model") -> None:
        from sparkcnn.inference import load_model_bytes

        model = load_model_bytes(data, name)  # validates on the driver and gives the shapes
        self._keras_bytes = data
        self._input_shape = tuple(int(d) for d in model.input_shape[1:])
        self._num_classes = int(model.output_shape[-1])

    @property
    def keras_model(self):
        """A fresh ``keras.Model`` of this Transformer's weights (loaded on the driver)."""
        from sparkcnn.inference import load_model_bytes

        return load_model_bytes(self._model_bytes())

    @property
    def numClasses(self) -> int:
        self._model_bytes()
        return self._num_classes

    def _model_bytes(self) -> bytes:
        if self._keras_bytes is None:
            raise BadInput("SparkCNNModel has no Keras model (build it with fit, from_keras or load)")
        return self._keras_bytes

    def _transform(self, dataset):
        from sparkcnn.inference import add_predictions

        return add_predictions(dataset, self._model_bytes(), self._input_shape,
                               features_col=self.getFeaturesCol(), prediction_col=self.getPredictionCol(),
                               probability_col=self.getProbabilityCol(),
                               raw_prediction_col=self.getRawPredictionCol(),
                               batch_size=self.getInferenceBatchSize())

    def setFeaturesCol(self, value): return self._set(featuresCol=value)
    def setPredictionCol(self, value): return self._set(predictionCol=value)
    def setProbabilityCol(self, value): return self._set(probabilityCol=value)
    def setRawPredictionCol(self, value): return self._set(rawPredictionCol=value)
    def setInferenceBatchSize(self, value): return self._set(inferenceBatchSize=value)
    def getRunDir(self): return self.getOrDefault(self.runDir)

    def write(self) -> "MLWriter":
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> "MLReader":
        return _ModelReader(cls)


class _ModelWriter(MLWriter):
    """``<path>/metadata`` (Spark's Params JSON) and ``<path>/model.keras``."""

    def __init__(self, instance: SparkCNNModel):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        data = self.instance._model_bytes()
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        write_bytes(self.sparkSession, _join(path, MODEL_FILE), data)


class _ModelReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> SparkCNNModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        model = self.cls()
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        where = _join(path, MODEL_FILE)
        model._set_model_bytes(read_bytes(self.sparkSession, where), where)
        return model


# -- model file I/O: local paths directly, other URIs through Hadoop's FileSystem (classic sessions)

def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def _local(path: str) -> str | None:
    if path.startswith("file://"):
        return path[len("file://"):]
    if path.startswith("file:"):
        return path[len("file:"):]
    return None if "://" in path else path


def write_bytes(spark, path: str, data: bytes) -> None:
    local = _local(path)
    if local is not None:
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        tmp = local + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, local)
        return
    fs, p = _hadoop(spark, path)
    out = fs.create(p, True)
    try:
        out.write(bytearray(data))
    finally:
        out.close()


def read_bytes(spark, path: str) -> bytes:
    local = _local(path)
    if local is not None:
        if not os.path.isfile(local):
            raise BadInput(f"{path}: no such model file")
        with open(local, "rb") as f:
            return f.read()
    fs, p = _hadoop(spark, path)
    if not fs.exists(p):
        raise BadInput(f"{path}: no such model file")
    jvm = spark.sparkContext._jvm
    stream = fs.open(p)
    try:
        return bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def _hadoop(spark, path: str):
    from sparkcnn.backends.session import is_connect

    if is_connect(spark):
        raise BadInput(f"{path}: a Spark Connect session saves and loads models on local paths only")
    sc = spark.sparkContext
    p = sc._jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(sc._jsc.hadoopConfiguration()), p
