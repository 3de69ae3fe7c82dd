"""Model builders by name (``fmnist_cnn``, ``resnet20``) or import path ``pkg.mod:fn``.

A builder takes ``(input_shape, num_classes)`` and returns an unbuilt-or-built
``keras.Model`` whose output is logits. :func:`build_model` builds it, seeds
Keras first so every process gets the same initial weights from the same seed.
"""

from __future__ import annotations

import importlib

from sparkcnn.errors import BadInput

BUILTIN = {
    "fmnist_cnn": "sparkcnn.models.fmnist:fmnist_cnn",
    "resnet20": "sparkcnn.models.resnet:resnet20",
}


def resolve_builder(name: str):
    """Return the builder function for a registered name or ``module:function``."""
    path = BUILTIN.get(name, name)
    if ":" not in path:
        raise BadInput(f"model.name {name!r}: unknown builder (known: {', '.join(BUILTIN)}; "
                       "or give module:function)")
    mod_name, fn_name = path.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise BadInput(f"model.name {name!r}: cannot import module {mod_name!r} ({e})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise BadInput(f"model.name {name!r}: module {mod_name!r} has no callable {fn_name!r}")
    return fn


def build_model(name: str, input_shape, num_classes: int, seed: int = 0, normalize=None):
    """Build the model with deterministic initial weights for ``seed``.

    ``normalize``: (mean, std) per channel in [0, 1] units (``data.normalize``), or None. The
    builder's model then sits behind a first layer that centres and scales each channel in
    pixel units, ``x -> (x - 255·mean) / std``: a builder that divides its input by 255, as
    the built-in ones do, sees ``(x/255 - mean) / std``. The layer holds no weights (the flat
    weight layout is the builder's), and a saved model carries it, so evaluation and
    prediction normalise as training did.
    """
    import keras

    fn = resolve_builder(name)
    keras.utils.set_random_seed(seed)
    try:
        model = fn(tuple(input_shape), int(num_classes))
    except Exception as e:  # a user builder failing is bad input, named
        raise BadInput(f"model.name {name!r}: builder raised {type(e).__name__}: {e}") from None
    if not isinstance(model, keras.Model):
        raise BadInput(f"model.name {name!r}: builder returned {type(model).__name__}, not a keras.Model")
    if not model.built:
        model.build((None, *input_shape))
    out = model.output_shape
    if out[-1] != num_classes:
        raise BadInput(f"model.name {name!r}: output has {out[-1]} units, dataset has {num_classes} classes")
    return model if normalize is None else _normalized(model, input_shape, *normalize)


def _normalized(model, input_shape, mean, std):
    """``model`` behind a per-channel normalisation in pixel units (:func:`build_model`)."""
    import keras

    inputs = keras.Input(shape=tuple(input_shape))
    scaled = keras.layers.Normalization(axis=-1, mean=[255.0 * m for m in mean],
                                        variance=[s * s for s in std], name="normalize")(inputs)
    return keras.Model(inputs, model(scaled), name=f"{model.name}_normalized")
