"""The model: a plain Keras function, nothing hpcdl-specific in it."""

import keras


def build(input_shape, filters=8, hidden=32):
    """A small CNN regressing three numbers per image: the peak's row, column and height."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(hidden, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x), name="peak_finder")
