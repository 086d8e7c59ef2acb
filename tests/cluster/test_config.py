"""TF_CONFIG parsing, validation and building (no TensorFlow involved)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tfscale
from tfscale.cluster import (
    ClusterConfig,
    cluster_from_env,
    parse_tf_config,
    tf_config,
    worker_device_kinds,
)

_W2 = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


def _raw(cluster: object = None, task: object = None, **extra: object) -> str:
    data: dict[str, object] = dict(extra)
    if cluster is not None:
        data["cluster"] = cluster
    if task is not None:
        data["task"] = task
    return json.dumps(data)


# (TF_CONFIG text, field the message must name, value the message must show)
MALFORMED = [
    pytest.param("{not json", "not valid JSON", "{not json", id="bad-json"),
    pytest.param("[1, 2]", "`TF_CONFIG`", "[1, 2]", id="not-an-object"),
    pytest.param(
        _raw(task={"type": "worker", "index": 0}), "`cluster`", "['task']", id="no-cluster"
    ),
    pytest.param(_raw(_W2), "`task`", "['cluster']", id="no-task"),
    pytest.param(_raw(_W2, {"index": 0}), "`task.type`", "'index': 0", id="no-task-type"),
    pytest.param(_raw(_W2, {"type": "worker"}), "`task.index`", "'type': 'worker'", id="no-index"),
    pytest.param(
        _raw(_W2, {"type": "worker", "index": "1"}), "`task.index`", "'1'", id="index-str"
    ),
    pytest.param(
        _raw(_W2, {"type": "worker", "index": True}), "`task.index`", "True", id="index-bool"
    ),
    pytest.param(_raw(_W2, {"type": "worker", "index": 2}), "`task.index`", "2", id="out-of-range"),
    pytest.param(_raw(_W2, {"type": "worker", "index": -1}), "`task.index`", "-1", id="negative"),
    pytest.param(
        _raw(_W2, {"type": "chief", "index": 0}), "`task.type`", "chief", id="type-absent"
    ),
    pytest.param(_raw(_W2, {"type": "boss", "index": 0}), "`task.type`", "boss", id="unknown-type"),
    pytest.param(
        _raw({"worker": ["a:1", "b:2"], "master": ["c:3"]}, {"type": "worker", "index": 0}),
        "`cluster.master`",
        "master",
        id="unknown-cluster-type",
    ),
    pytest.param(
        _raw({"worker": ["a:1", "a:1"]}, {"type": "worker", "index": 0}),
        "`cluster.worker[1]`",
        "a:1",
        id="duplicate",
    ),
    pytest.param(
        _raw({"chief": ["a:1"], "worker": ["a:1"]}, {"type": "worker", "index": 0}),
        "`cluster.worker[0]`",
        "cluster.chief[0]",
        id="duplicate-across-types",
    ),
    pytest.param(
        _raw({"worker": ["a:1", "hostonly"]}, {"type": "worker", "index": 0}),
        "`cluster.worker[1]`",
        "hostonly",
        id="no-port",
    ),
    pytest.param(
        _raw({"worker": ["a:1", "b:99999"]}, {"type": "worker", "index": 0}),
        "`cluster.worker[1]`",
        "b:99999",
        id="bad-port",
    ),
    pytest.param(
        _raw({"worker": ["a:1", ":2"]}, {"type": "worker", "index": 0}),
        "`cluster.worker[1]`",
        ":2",
        id="no-host",
    ),
    pytest.param(
        _raw({"worker": "a:1,b:2"}, {"type": "worker", "index": 0}),
        "`cluster.worker`",
        "a:1,b:2",
        id="addresses-not-list",
    ),
    pytest.param(
        _raw({"chief": ["a:1", "b:2"]}, {"type": "chief", "index": 0}),
        "`cluster.chief`",
        "['a:1', 'b:2']",
        id="two-chiefs",
    ),
    pytest.param(_raw({}, {"type": "worker", "index": 0}), "`cluster`", "{}", id="empty-cluster"),
    pytest.param(_raw(_W2, "worker"), "`task`", "worker", id="task-not-object"),
]


@pytest.mark.parametrize(("raw", "field", "value"), MALFORMED)
def test_malformed_tf_config_names_the_field_and_value(raw: str, field: str, value: str) -> None:
    with pytest.raises(tfscale.ClusterConfigError) as info:
        parse_tf_config(raw)
    message = str(info.value)
    assert field in message
    assert value in message
    assert "Fix:" in message


def test_cluster_from_env_reads_tf_config_and_rejects_bad_json() -> None:
    assert cluster_from_env({}) is None
    assert cluster_from_env({"TF_CONFIG": "  "}) is None
    single = tf_config(["127.0.0.1:2222"], 0)
    assert cluster_from_env({"TF_CONFIG": single}) is None  # one task: no multi-worker
    config = cluster_from_env({"TF_CONFIG": tf_config(["h0:1", "h1:2"], 1)})
    assert config is not None and config.num_workers == 2 and config.address == "h1:2"
    with pytest.raises(tfscale.ClusterConfigError, match="not valid JSON"):
        cluster_from_env({"TF_CONFIG": "{'cluster': 1}"})


def test_build_and_parse_round_trip() -> None:
    raw = tf_config(["h1:2222", "h2:2222"], 1, chief="h0:2222", ps=["p0:2000"])
    config = parse_tf_config(raw)
    assert config.cluster == {
        "chief": ("h0:2222",),
        "worker": ("h1:2222", "h2:2222"),
        "ps": ("p0:2000",),
    }
    assert (config.task_type, config.task_index) == ("worker", 1)
    assert config.workers == ("h0:2222", "h1:2222", "h2:2222")
    assert config.num_workers == 3 and config.num_ps == 1
    assert config.worker_rank == 2 and not config.is_chief and config.address == "h2:2222"
    assert parse_tf_config(config.to_json()) == config
    assert json.loads(raw) == config.as_dict()


def test_chief_rules() -> None:
    assert parse_tf_config(tf_config(["a:1", "b:2"], 0)).is_chief  # worker 0 without a chief
    with_chief = parse_tf_config(tf_config(["a:1"], 0, task_type="chief", chief="c:3"))
    assert with_chief.is_chief and with_chief.worker_rank == 0
    assert not parse_tf_config(tf_config(["a:1"], 0, chief="c:3")).is_chief


def test_ipv6_and_evaluator_outside_cluster() -> None:
    config = parse_tf_config(tf_config(["[::1]:2222", "[::1]:2223"], 0))
    assert config.address == "[::1]:2222"
    evaluator = parse_tf_config(_raw(_W2, {"type": "evaluator", "index": 0}))
    assert evaluator.worker_rank is None and evaluator.address is None
    with pytest.raises(tfscale.ClusterConfigError, match=r"task\.index"):
        parse_tf_config(_raw(_W2, {"type": "evaluator", "index": 1}))


def test_tf_config_builder_validates() -> None:
    with pytest.raises(tfscale.ClusterConfigError, match=r"task\.index"):
        tf_config(["a:1", "b:2"], 2)
    with pytest.raises(tfscale.ClusterConfigError, match="address"):
        tf_config(["a:1", "b:1", "a:1"], 0)
    with pytest.raises(tfscale.ClusterConfigError):
        ClusterConfig({"worker": ("a:1",)}, "worker", 3)


def test_worker_device_kinds() -> None:
    config = parse_tf_config(tf_config(["a:1", "b:2", "c:3"], 0))
    assert worker_device_kinds(config, {}) is None
    env = {"TFSCALE_WORKER_DEVICE_KINDS": "gpu, GPU ,CPU"}
    assert worker_device_kinds(config, env) == ("GPU", "GPU", "CPU")
    assert worker_device_kinds(config, {"TFSCALE_WORKER_DEVICE_KINDS": "GPU"}) == ("GPU",) * 3
    for bad in ("GPU,CPU", "GPU,TPU,CPU"):
        with pytest.raises(tfscale.ClusterConfigError, match="TFSCALE_WORKER_DEVICE_KINDS"):
            worker_device_kinds(config, {"TFSCALE_WORKER_DEVICE_KINDS": bad})


@pytest.mark.multiprocess
def test_cluster_module_imports_no_tensorflow() -> None:
    code = "import sys, tfscale.cluster; print('tensorflow' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
