"""Cluster sources: plain TF_CONFIG, Slurm and Kubernetes (TFJob), chosen in one place."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import tfscale
from tfscale.cluster import (
    SOURCE_ENV,
    KubernetesSource,
    SlurmSource,
    TFConfigSource,
    choose_source,
    cluster_from_env,
    cluster_from_kubernetes,
    cluster_from_slurm,
    tf_config,
)
from tfscale.errors import ClusterConfigError

_ENVS = Path(__file__).parent / "data" / "cluster_envs"


def _recorded(name: str) -> dict[str, str]:
    """An environment as `env` prints it (tests/cluster/data/cluster_envs/README.md)."""
    lines = (_ENVS / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip())


@pytest.mark.parametrize(
    ("name", "source", "task", "workers"),
    [
        ("tfjob-worker-1.env", "Kubernetes", ("worker", 1), 3),
        ("srun-task-3.env", "Slurm", ("worker", 3), 4),
        ("launch-worker-1.env", "TF_CONFIG", ("worker", 1), 2),
        ("laptop.env", None, None, 0),
    ],
)
def test_each_environment_resolves_through_the_one_start_up_path(
    name: str, source: str | None, task: tuple[str, int] | None, workers: int
) -> None:
    env = _recorded(name)
    chosen = choose_source(env)
    assert (chosen.name if chosen else None) == source
    config = cluster_from_env(env)  # what choose_strategy reads, through gather_facts
    if config is None:
        assert task is None
        return
    assert (config.source, (config.task_type, config.task_index)) == (source, task)
    assert config.num_workers == workers


def test_recorded_slurm_task_is_in_block_order() -> None:
    config = cluster_from_env(_recorded("srun-task-3.env"))
    assert config is not None and config.address == "gpu08:8889"
    assert config.workers == ("gpu07:8888", "gpu07:8889", "gpu08:8888", "gpu08:8889")


def test_recorded_tfjob_pod_knows_its_chief_and_ps() -> None:
    config = cluster_from_env(_recorded("tfjob-worker-1.env"))
    assert config is not None and config.worker_rank == 2 and config.num_ps == 1
    assert config.address == "mnist-worker-1.ml.svc:2222" and not config.is_chief


@pytest.mark.tf
@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"HOSTNAME": "mnist-worker-0"}, "this pod is 'mnist-worker-0'"),  # copied TF_CONFIG
        (
            {"TF_CONFIG": tf_config(["10.0.0.1:2222", "10.0.0.2:2222"], 1)},
            "an IP address, not the service name",
        ),
    ],
)
def test_a_misconfigured_tfjob_pod_fails_at_start_up(
    change: dict[str, str], words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _recorded("tfjob-worker-1.env") | change
    with pytest.raises(ClusterConfigError, match=words) as caught:
        cluster_from_env(env)
    if "10.0.0.1" in env["TF_CONFIG"]:
        assert f"{SOURCE_ENV}=TF_CONFIG" in str(caught.value)  # the way out for a non-TFJob pod
    # choose_strategy refuses it before touching any device or building anything.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ClusterConfigError, match=words):
        tfscale.choose_strategy()


def test_a_launcher_written_tf_config_in_a_pod_is_read_as_written() -> None:
    # `tfscale launch -n 2` inside a pod: its workers' TF_CONFIG names 127.0.0.1, and the
    # launcher says so with TFSCALE_CLUSTER_SOURCE=TF_CONFIG.
    pod = _recorded("tfjob-worker-1.env")
    launched = pod | _recorded("launch-worker-1.env")
    config = cluster_from_env(launched)
    assert config is not None and config.source == "TF_CONFIG" and config.task_index == 1
    without = launched | {SOURCE_ENV: ""}
    with pytest.raises(ClusterConfigError, match="an IP address"):
        cluster_from_env(without)


def test_the_source_can_be_named_or_switched_off() -> None:
    slurm = _recorded("srun-task-3.env")
    assert cluster_from_env(slurm | {SOURCE_ENV: "none"}) is None
    forced = cluster_from_env(_recorded("laptop.env") | slurm | {SOURCE_ENV: "slurm"})
    assert forced is not None and forced.source == "Slurm"
    with pytest.raises(ClusterConfigError, match="names no cluster source"):
        cluster_from_env(slurm | {SOURCE_ENV: "yarn"})
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not set"):
        cluster_from_env(slurm | {SOURCE_ENV: "TF_CONFIG"})


def test_detection_of_each_source() -> None:
    pod, task = _recorded("tfjob-worker-1.env"), _recorded("srun-task-3.env")
    assert KubernetesSource.detect(pod) and TFConfigSource.detect(pod)
    assert not KubernetesSource.detect({k: v for k, v in pod.items() if k != "TF_CONFIG"})
    assert SlurmSource.detect(task) and not TFConfigSource.detect(task)
    # An interactive allocation's shell is not a job step of workers.
    assert not SlurmSource.detect(task | {"SLURM_JOB_NAME": "interactive"})
    # TF_CONFIG written by `tfscale launch --slurm` wins over Slurm's own variables.
    written = task | {"TF_CONFIG": tf_config(["gpu07:9000", "gpu08:9000"], 1)}
    source = choose_source(written)
    assert source is not None and source.name == "TF_CONFIG"


_SLURM = {
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def test_slurm_cluster_in_block_order() -> None:
    config = cluster_from_slurm(_SLURM, port_base=7000)
    assert config.cluster["worker"] == ("node01:7000", "node01:7001", "node02:7000", "node02:7001")
    assert (config.task_type, config.task_index, config.source) == ("worker", 1, "Slurm")


def test_slurm_job_wide_variables_are_the_fallback() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "3",
        "SLURM_JOB_NODELIST": "a,b[1-2]",
        "SLURM_TASKS_PER_NODE": "1(x3)",
    }
    assert cluster_from_slurm(env).cluster["worker"] == ("a:8888", "b1:8888", "b2:8888")


# (change to the valid environment, the variable the error must name, words it must say)
_SLURM_CASES = [
    ({"SLURM_PROCID": None}, "SLURM_PROCID", "not set"),
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID", "integer"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID", "integer"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID", "out of range for 4 tasks"),
    ({"SLURM_STEP_NUM_TASKS": None}, "SLURM_STEP_NUM_TASKS", "not set"),
    ({"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS", "integer"),
    ({"SLURM_STEP_NODELIST": None}, "SLURM_STEP_NODELIST", "not set"),
    ({"SLURM_STEP_NODELIST": "node[01-02"}, "SLURM_STEP_NODELIST", "'[' without ']'"),
    ({"SLURM_STEP_NODELIST": "node[02-01]"}, "SLURM_STEP_NODELIST", "backwards"),
    ({"SLURM_STEP_NODELIST": "node[a-b]"}, "SLURM_STEP_NODELIST", "not N or N-M"),
    ({"SLURM_STEP_NODELIST": "n1,n1"}, "SLURM_STEP_NODELIST", "listed twice"),
    ({"SLURM_STEP_TASKS_PER_NODE": None}, "SLURM_STEP_TASKS_PER_NODE", "not set"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE", "not a valid"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "SLURM_STEP_TASKS_PER_NODE", "3 node count(s) for 2"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2"}, "SLURM_STEP_TASKS_PER_NODE", "add up to 5, not 4"),
]


@pytest.mark.parametrize(("change", "field", "words"), _SLURM_CASES)
def test_malformed_slurm_environment_names_the_variable(
    change: dict[str, str | None], field: str, words: str
) -> None:
    env = {k: v for k, v in (_SLURM | change).items() if v is not None}
    with pytest.raises(ClusterConfigError) as caught:
        cluster_from_slurm(env)
    message = str(caught.value)
    assert field in message and words in message and "srun" in message


def test_slurm_ports_out_of_range() -> None:
    with pytest.raises(ClusterConfigError, match="port_base"):
        cluster_from_slurm(_SLURM, port_base=65535)


@pytest.fixture
def _slurm_os_environ() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}
    yield
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.mark.tf
@pytest.mark.usefixtures("_slurm_os_environ")
@pytest.mark.parametrize(
    ("nodelist", "per_node", "ntasks"),
    [("node[01-03,07]", "1(x4)", 4), ("gpu[1-2]", "2(x2)", 4), ("a1,b[3-4]", "2,1(x2)", 4)],
)
def test_slurm_matches_tensorflows_slurm_cluster_resolver(
    nodelist: str, per_node: str, ntasks: int
) -> None:
    import tensorflow as tf

    for rank in range(ntasks):
        env = {
            "SLURM_PROCID": str(rank),
            "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_STEP_NODELIST": nodelist,
            "SLURM_STEP_TASKS_PER_NODE": per_node,
        }
        os.environ.update(env)
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=8888, gpus_per_node=2, gpus_per_task=1, auto_set_gpu=False
        )
        spec = resolver.cluster_spec().as_dict()
        ours = cluster_from_slurm(env, port_base=8888)
        assert list(ours.cluster["worker"]) == spec["worker"]
        assert (ours.task_type, ours.task_index) == (resolver.task_type, resolver.task_id)


def _tfjob_config(task_type: str, index: int) -> str:
    cluster = {
        "chief": ["mnist-chief-0.ml.svc:2222"],
        "worker": ["mnist-worker-0.ml.svc:2222", "mnist-worker-1.ml.svc:2222"],
        "ps": ["mnist-ps-0.ml.svc:2222"],
    }
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_kubernetes_tfjob_config_is_accepted() -> None:
    env = {"TF_CONFIG": _tfjob_config("worker", 1), "HOSTNAME": "mnist-worker-1"}
    config = cluster_from_kubernetes(env)
    assert (config.task_type, config.task_index, config.source) == ("worker", 1, "Kubernetes")
    assert config.num_ps == 1 and config.address == "mnist-worker-1.ml.svc:2222"


def _swap_workers(raw: str) -> str:
    data = json.loads(raw)
    data["cluster"]["worker"].reverse()
    return json.dumps(data)


# (environment, the field the error must name, words it must say)
_K8S_CASES = [
    ({}, "TF_CONFIG", "not set"),
    ({"TF_CONFIG": "{"}, "TF_CONFIG", "not valid JSON"),
    ({"TF_CONFIG": _tfjob_config("trainer", 0)}, "task.type", "unknown task type"),
    ({"TF_CONFIG": _tfjob_config("worker", 2)}, "task.index", "out of range"),
    (
        {"TF_CONFIG": _tfjob_config("worker", 0).replace("mnist-ps-0.ml.svc", "10.0.0.9")},
        "cluster.ps[0]",
        "service name",
    ),
    (
        {
            "TF_CONFIG": _tfjob_config("worker", 0)
            .replace("Mnist", "x")
            .replace("mnist-chief-0", "Mnist_Chief")
        },
        "cluster.chief[0]",
        "not a Kubernetes service DNS",
    ),
    (
        {"TF_CONFIG": _swap_workers(_tfjob_config("worker", 0))},
        "cluster.worker[0]",
        "not the address of worker 0",
    ),
    (
        {"TF_CONFIG": _tfjob_config("worker", 0), "HOSTNAME": "mnist-worker-1"},
        "task",
        "this pod is 'mnist-worker-1'",
    ),
]


@pytest.mark.parametrize(("env", "field", "words"), _K8S_CASES)
def test_malformed_tfjob_environment_names_the_field(
    env: dict[str, str], field: str, words: str
) -> None:
    with pytest.raises(ClusterConfigError) as caught:
        cluster_from_kubernetes(env)
    assert field in str(caught.value) and words in str(caught.value)
