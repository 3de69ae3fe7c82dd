"""Spark ML: :class:`SparkCNNClassifier` (an Estimator) and :class:`SparkCNNModel` (its Transformer).

They read like Spark's own classifiers: the shared column Params
(``featuresCol`` is the image column), ``@keyword_only`` constructors,
setters and getters, ``save``/``load``, and they work in a ``Pipeline``, with
``MulticlassClassificationEvaluator`` and in a ``CrossValidator``::

    clf = SparkCNNClassifier(featuresCol="image", labelCol="label", epochs=1, imageShape=[28, 28, 1])
    model = clf.fit(train_df)                      # sparkcnn.fit on the DataFrame
    scored = model.transform(test_df)              # + rawPrediction, probability, prediction

``fit`` trains with :func:`sparkcnn.fit`; the Params (:mod:`sparkcnn.ml_params`)
map onto config keys (``epochs`` → ``train.epochs``, ...). ``transform`` runs
the Arrow UDF of :mod:`sparkcnn.inference` on the executors; the model goes
with it as the bytes of its ``.keras`` file. A saved model is a directory with
the Params in ``metadata/`` (Spark's own format) and ``model.keras`` beside it
(:mod:`sparkcnn.ml_io`).

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
from pyspark.ml.util import (DefaultParamsReadable, DefaultParamsWritable, MLReadable, MLReader, MLWritable,
                             MLWriter)

from sparkcnn.errors import BadInput
from sparkcnn.ml_io import MODEL_FILE, ModelReader, ModelWriter
from sparkcnn.ml_params import ClassifierParams, SparkCNNParams
from sparkcnn.protocol import steps_per_epoch

log = logging.getLogger(__name__)

# An unset batchSize is halved while an epoch has fewer steps per block than this. Measured, 3-epoch
# fits on 4,000 Fashion-MNIST rows in 2 blocks (seeds 1, 2, 3, 42; full test set): batch 64, 31 steps
# (H = 7), reached 0.70-0.75; batch 32, 62 steps (H = 15), 0.775-0.788.
MIN_EPOCH_STEPS = 50
MIN_DATA_BATCH = 16  # the smallest batch chosen: below it a Keras step's fixed cost dominates its images


class SparkCNNClassifier(Estimator, ClassifierParams, DefaultParamsReadable, DefaultParamsWritable):
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
    log.info("SparkCNNClassifier: batchSize unset, using %d: %d steps an epoch per block "
             "(%d rows in %d blocks); the default %d is halved while an epoch has under %d, down to %d",
             batch, steps_per_epoch(per_block, batch), rows, cfg.data.num_blocks, cfg.train.batch_size,
             MIN_EPOCH_STEPS, MIN_DATA_BATCH)
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
             "takes per block (%d rows in %d blocks, batch %d) and at most the default %d",
             chosen, steps, rows, cfg.data.num_blocks, cfg.train.batch_size, cfg.train.steps_per_round)
    return chosen


class SparkCNNModel(Model, SparkCNNParams, MLReadable, MLWritable):
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
        return ModelWriter(self)

    @classmethod
    def read(cls) -> "MLReader":
        return ModelReader(cls)
