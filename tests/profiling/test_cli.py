"""``tfscale bench`` and ``tfscale profile`` end to end, in one fresh process (own devices)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tfscale.chatter import is_chatter
from tfscale.testing import run_python

_SCRIPT = textwrap.dedent(
    """
    import sys
    import keras, numpy as np, tensorflow as tf
    from neighbour import WIDTH  # sub/neighbour.py, next to the script
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(WIDTH, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.standard_normal((1024, 32)).astype("float32"), rng.integers(0, 10, 1024))
    ).batch(64)
    model.fit(data, epochs=int(sys.argv[1]), verbose=0)
    """
)


def test_bench_and_profile_commands_write_reports(tmp_path: Path) -> None:
    # `tfscale profile sub/train.py` runs the script as `python sub/train.py` would (and as
    # `doctor --script` does): its folder is on sys.path, so it imports its neighbours.
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text(_SCRIPT)
    (tmp_path / "sub" / "neighbour.py").write_text("WIDTH = 64\n")
    code = f"""
    import sys
    from tfscale.cli.main import main
    bench = main(["bench", "--model", "mlp", "--replicas", "1,2", "--steps", "5",
                  "--warmup", "2", "--trace-steps", "2", "--out", {str(tmp_path / "bench")!r}])
    profile = main(["profile", "--out", {str(tmp_path / "profile")!r}, "--trace-steps", "4,8",
                    "sub/train.py", "2"])
    sys.exit(bench * 10 + profile)
    """
    done = run_python(
        code,
        env={"TFSCALE_VIRTUAL_DEVICES": "2", "TF_CPP_MIN_LOG_LEVEL": ""},
        timeout=240,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # As for a user: no TensorFlow start-up chatter, from bench or from profile's child.
    lines = (done.stdout + done.stderr).splitlines()
    assert not [line for line in lines if is_chatter(line) or "oneDNN" in line]
    bench = json.loads((tmp_path / "bench" / "report.json").read_text())
    modes = {(p["mode"], p["replicas"]) for p in bench["points"]}
    assert modes == {("weak", 1), ("weak", 2), ("strong", 1), ("strong", 2)}
    weak2 = next(p for p in bench["points"] if p["mode"] == "weak" and p["replicas"] == 2)
    assert weak2["trace_shares"] and abs(sum(weak2["trace_shares"].values()) - 1) < 1e-6
    assert bench["collectives"][0]["busbw"] == bench["collectives"][0]["algbw"]  # 2 ranks
    assert "Report:" in done.stdout and (tmp_path / "bench" / "report.html").exists()
    profiled = json.loads((tmp_path / "profile" / "report.json").read_text())
    (point,) = profiled["points"]
    assert point["mode"] == "script" and point["replicas"] == 2 and point["global_batch"] == 64
    # Mirrored over 2 devices: the trace sees the all-reduce and the input fetch.
    assert point["method"] == "trace" and point["trace_shares"]["compute"] > 0
    assert point["trace_shares"]["communication"] + point["trace_shares"]["input"] > 0
