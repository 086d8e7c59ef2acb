"""A model built outside any scope, trained with tfscale.fit (which moves its variables into
the strategy's scope in place before the first step): nothing for the doctor to report."""

import keras
import numpy as np

import tfscale

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
strategy = tfscale.choose_strategy().strategy  # the 2 logical devices the doctor gave
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)), rng.normal(size=(64, 1))
tfscale.fit(model, x, y, batch_size=16, epochs=1, verbose=0, strategy=strategy)
