"""sparkcnn: data-parallel CNN training on Spark with sparse communication.

    import sparkcnn
    result = sparkcnn.fit("conf/fashion_mnist.yaml", data=df)   # or a path, a table, an image folder
    result.model, result.history, result.plot()

``sparkcnn.ml.SparkCNNClassifier`` is the same training as a Spark ML Estimator.
"""

__version__ = "0.1.0"

__all__ = ["fit", "Result", "__version__"]


def __getattr__(name):  # lazy: importing sparkcnn stays cheap (no Spark, no TensorFlow)
    if name in ("fit", "Result"):
        from sparkcnn import api

        return getattr(api, name)
    raise AttributeError(f"module 'sparkcnn' has no attribute {name!r}")
