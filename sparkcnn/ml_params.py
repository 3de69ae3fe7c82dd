"""The Params of :mod:`sparkcnn.ml`'s Estimator and Model, declared once, as Spark's shared mixins are.

:class:`SparkCNNParams` are the ones both share (the columns, the inference
batch size); :class:`ClassifierParams` add the training Params, each of which
maps onto one config key (:data:`CONFIG_KEYS`), so that the Estimator's
``fit`` is :func:`sparkcnn.fit` with the Params as ``section.key=value``
overrides (:meth:`ClassifierParams.config_overrides`).
"""

from __future__ import annotations

import json

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (HasFeaturesCol, HasLabelCol, HasPredictionCol, HasProbabilityCol,
                                     HasRawPredictionCol, HasSeed)

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


class SparkCNNParams(HasFeaturesCol, HasPredictionCol, HasProbabilityCol, HasRawPredictionCol):
    """Params the Estimator and the Model share: the columns and the inference batch size."""

    inferenceBatchSize = Param(Params._dummy(), "inferenceBatchSize",
                               "images per model call in transform (bounds executor memory)",
                               typeConverter=TypeConverters.toInt)

    def __init__(self, *args):
        super().__init__(*args)
        self._setDefault(featuresCol="image", inferenceBatchSize=256)

    def getInferenceBatchSize(self) -> int:
        return self.getOrDefault(self.inferenceBatchSize)


class ClassifierParams(SparkCNNParams, HasLabelCol, HasSeed):
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
    lrWarmupEpochs = Param(Params._dummy(), "lrWarmupEpochs",
                           "linear lr warm-up, in epochs (train.lr_warmup_epochs)",
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
                      "auto (default: jobs on a classic session, stream on Spark Connect) | jobs "
                      "(a Spark job per exchange; classic sessions) | stream (engine.transport)",
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
