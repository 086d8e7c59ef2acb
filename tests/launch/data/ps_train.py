"""The chief of a parameter-server job: choose_strategy -> ParameterServerStrategy -> tfscale.fit.

Usage: ps_train.py OUT_JSON. Run by `tfscale launch --ps 1 -n 2`; writes the strategy kind and
the full-data loss before and after training.
"""

import json
import sys

import keras
import numpy as np

import tfscale

choice = tfscale.choose_strategy()
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
keras.utils.set_random_seed(0)
with choice.strategy.scope():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")


def full_loss() -> float:
    return float(np.mean((model(x).numpy() - y) ** 2))


before = full_loss()
try:  # an option that needs synchronous training is refused, and named
    tfscale.fit(model, x, y, epochs=1, global_clipnorm=1.0, accumulation_steps=2)
    refused = ""
except tfscale.TrainingError as error:
    refused = str(error)
history = tfscale.fit(model, x, y, epochs=3, batch_size=32, verbose=1)
result = {
    "kind": choice.kind,
    "before": before,
    "after": full_loss(),
    "refused": refused,
    **history.history,
}
with open(sys.argv[1], "w") as handle:
    json.dump(result, handle)
print(json.dumps(result))
