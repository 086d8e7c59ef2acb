"""Every ``tfscale.fit`` argument under ParameterServerStrategy: honoured, or refused before
any work with a TrainingError that names it and its fix (#25.1).

The arguments are read from ``tfscale.fit``'s signature, so an argument added to it fails
here until it is given a value below and the coordinator loop honours or refuses it.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import tfscale
from tfscale.testing import run_python
from tfscale.training.coordinator import HONOURED, refuse_unsupported

# One worker runs this module (make test: --dist loadgroup), so its module fixture runs once.
pytestmark = [
    pytest.mark.tf,
    pytest.mark.xdist_group("ps-arguments"),
]

# Each fit argument -> a Python expression setting it away from its default (names: np,
# keras, x, y, model, strategy, folder, Recorder). The baseline call sets model, x, y and
# strategy; epochs=2 comes with initial_epoch.
SET = {
    "model": "model",
    "x": "x",
    "y": "y",
    "batch_size": "16",
    "epochs": "2",
    "verbose": "1",
    "callbacks": "[Recorder()]",
    "validation_split": "0.25",
    "validation_data": "(x, y)",
    "shuffle": "False",
    "class_weight": "{0: 1.0, 1: 2.0}",
    "sample_weight": "np.zeros(len(x), 'float32')",
    "initial_epoch": "1",
    "steps_per_epoch": "3",
    "validation_steps": "2",
    "validation_batch_size": "8",
    "validation_freq": "2",
    "data": "(x, y)",
    "strategy": "strategy",
    "accumulation_steps": "2",
    "steps_per_execution": "2",
    "mixed_precision": "'bf16'",
    "global_clipnorm": "1.0",
    "remat": "True",
    "jit_compile": "True",
    "sync_batchnorm": "True",
    "global_load_balancing": "True",
    "bucket_bytes": "1024",
    "gradient_compression": "'bf16'",
    "shard_optimizer_state": "True",
    "checkpoint_dir": "str(folder)",
    "clipnorm": "1.0",
    "options": "tfscale.Options()",
}

FIT_ARGUMENTS = list(inspect.signature(tfscale.fit).parameters)


class Recorder(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[int] = []

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.epochs.append(epoch)


@pytest.mark.parametrize("name", FIT_ARGUMENTS)
def test_the_coordinator_loop_honours_or_names_each_fit_argument(name: str, tmp_path: Path) -> None:
    assert name in SET, f"tfscale.fit has a new argument {name!r}: give it a value in SET"
    if name in HONOURED:
        return
    x, y = np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32")
    value = eval(SET[name], {"np": np, "x": x, "y": y, "folder": tmp_path})
    defaults = {n: p.default for n, p in inspect.signature(tfscale.fit).parameters.items()}
    with pytest.raises(tfscale.TrainingError, match=f"does not support: {name}") as info:
        refuse_unsupported({name: value}, defaults)
    assert f"\n    {name}: " in str(info.value) and "Fix:" in str(info.value)


_CHILD = """
import contextlib, io, json, sys, tempfile
from pathlib import Path
import keras, numpy as np, tensorflow as tf
import tfscale
from tfscale.testing import in_process_parameter_servers

strategy = in_process_parameter_servers(workers=2)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = (x[:, :1] > 0).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")

class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.steps = [], None
    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)
        self.steps = self.params.get("steps")

SET, NAMES = json.loads(sys.argv[1]), json.loads(sys.argv[2])
results = {}
for name in NAMES:
    folder = Path(tempfile.mkdtemp()) / "ckpt"
    value = eval(SET[name])
    kwargs = {"model": model, "x": x, "y": y, "strategy": strategy, "verbose": 0, name: value}
    if name == "data":
        del kwargs["x"], kwargs["y"]
    if name == "initial_epoch":
        kwargs["epochs"] = 2
    # Steps and epochs as the loop scheduled them.
    recorder = value[0] if name == "callbacks" else Recorder()
    kwargs["callbacks"] = [recorder]
    before = int(model.optimizer.iterations.numpy())
    weights = model.get_weights()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            history = tfscale.fit(**kwargs)
    except tfscale.TrainingError as error:
        message = str(error)
        ok = (name in message and "Fix:" in message and not folder.exists()
              and int(model.optimizer.iterations.numpy()) == before)
        results[name] = {"outcome": "refused", "ok": ok, "detail": message}
        continue
    except Exception as error:
        results[name] = {"outcome": "error", "ok": False, "detail": repr(error)}
        continue
    steps, epochs = recorder.steps, recorder.epochs
    effect = {
        "batch_size": steps == 4,
        "epochs": epochs == [0, 1] == history.epoch,
        "initial_epoch": epochs == [1] == history.epoch,
        "steps_per_epoch": steps == 3,
        "verbose": "Epoch 1/1" in out.getvalue(),
        "sample_weight": all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights())),
        "checkpoint_dir": tf.train.latest_checkpoint(str(folder)) is not None,
    }.get(name, steps == 2 and epochs == [0])
    results[name] = {"outcome": "honoured", "ok": bool(effect),
                     "detail": f"steps={steps} epochs={history.epoch} out={out.getvalue()!r}"}
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def under_parameter_server() -> dict[str, Any]:
    """Each fit argument set in turn, on an in-process cluster (1 ps, 2 workers)."""
    names = [n for n in FIT_ARGUMENTS if n in SET]
    done = run_python(_CHILD, args=[json.dumps(SET), json.dumps(names)], timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    results: dict[str, Any] = json.loads(lines[-1][len("RESULTS ") :])
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", FIT_ARGUMENTS)
def test_each_fit_argument_is_honoured_or_refused_under_parameter_server(
    name: str, under_parameter_server: dict[str, Any]
) -> None:
    result = under_parameter_server.get(name)
    assert result is not None, f"no value for {name!r} in SET"
    expected = "honoured" if name in HONOURED else "refused"
    assert result["outcome"] == expected and result["ok"], result
