"""The Fashion-MNIST CNN: conv32-pool-conv64-pool-dense128-dense10 (~225k parameters)."""

import keras
from keras import layers


def fmnist_cnn(input_shape, num_classes):
    """3x3 convs with 'valid' padding: 28x28 -> 26 -> 13 -> 11 -> 5, 5*5*64 = 1600 -> 128 -> classes."""
    return keras.Sequential(
        [
            keras.Input(shape=input_shape),
            layers.Rescaling(1.0 / 255),
            layers.Conv2D(32, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(128, activation="relu"),
            layers.Dense(num_classes),
        ],
        name="fmnist_cnn",
    )
