"""CIFAR ResNet-20 (He et al. 2016, section 4.2): 3 stages x 3 basic blocks, 16/32/64 filters.

~0.27 M parameters; BatchNorm moving statistics are non-trainable weights and
travel dense (they are averaged on the server, not summed as gradients).
"""

import keras
from keras import layers


def _block(x, filters, stride):
    shortcut = x
    y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                      kernel_initializer="he_normal")(x)
    y = layers.BatchNormalization()(y)
    y = layers.Activation("relu")(y)
    y = layers.Conv2D(filters, 3, padding="same", use_bias=False, kernel_initializer="he_normal")(y)
    y = layers.BatchNormalization()(y)
    if stride != 1 or shortcut.shape[-1] != filters:
        # option B projection shortcut: 1x1 conv + BN when the shape changes
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
        shortcut = layers.BatchNormalization()(shortcut)
    return layers.Activation("relu")(layers.Add()([y, shortcut]))


def resnet20(input_shape, num_classes, depth=20):
    n = (depth - 2) // 6
    inputs = keras.Input(shape=input_shape)
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(16, 3, padding="same", use_bias=False, kernel_initializer="he_normal")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    for stage, filters in enumerate((16, 32, 64)):
        for i in range(n):
            x = _block(x, filters, 2 if (stage > 0 and i == 0) else 1)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")
