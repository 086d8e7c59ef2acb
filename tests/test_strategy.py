"""Strategy choice: pure rules over faked facts, real logical CPUs, real worker processes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

import tfscale
from tfscale.cluster import ClusterConfig, parse_tf_config, tf_config
from tfscale.launch.ports import free_ports
from tfscale.strategy import StrategyFacts, decide, gather_facts, normalize_device
from tfscale.testing import run_python


def _facts(
    gpus: int = 0,
    cpus: int = 1,
    *,
    physical_gpus: int | None = None,
    platform: str = "linux",
    nccl: bool | None = None,
    cluster: ClusterConfig | None = None,
    kinds: Sequence[str] | None = None,
) -> StrategyFacts:
    logical = {"CPU": tuple(f"/device:CPU:{i}" for i in range(cpus))}
    if gpus:
        logical["GPU"] = tuple(f"/device:GPU:{i}" for i in range(gpus))
    return StrategyFacts(
        platform=platform,
        physical_gpus=gpus if physical_gpus is None else physical_gpus,
        logical_devices=logical,
        nccl_available=(platform == "linux" and gpus > 0) if nccl is None else nccl,
        cluster=cluster,
        worker_device_kinds=tuple(kinds) if kinds else None,
    )


def _two_workers(index: int = 0) -> ClusterConfig:
    return parse_tf_config(tf_config(["10.0.0.1:2222", "10.0.0.2:2222"], index))


# ---------------------------------------------------------------- pure rules, faked facts


def test_no_gpu_one_cpu_is_one_device_on_cpu() -> None:
    decision = decide(_facts(gpus=0, cpus=1))
    assert (decision.kind, decision.devices, decision.num_replicas) == (
        "OneDevice",
        ("/device:CPU:0",),
        1,
    )
    assert decision.cross_device_ops is None
    assert "No GPU and one CPU device" in decision.reasons[0]


def test_one_gpu_is_one_device_on_the_gpu_even_with_cpu_splits() -> None:
    decision = decide(_facts(gpus=1, cpus=4))
    assert (decision.kind, decision.devices) == ("OneDevice", ("/device:GPU:0",))
    assert "One local GPU" in decision.reasons[0]


def test_four_gpus_on_linux_mirror_with_nccl() -> None:
    decision = decide(_facts(gpus=4))
    assert decision.kind == "Mirrored" and decision.num_replicas == 4
    assert decision.devices == tuple(f"/device:GPU:{i}" for i in range(4))
    assert decision.cross_device_ops == "NcclAllReduce"
    assert "4 local GPUs" in decision.reasons[0] and "NCCL is available" in decision.reasons[1]


def test_four_gpus_on_windows_use_hierarchical_copy() -> None:
    decision = decide(_facts(gpus=4, platform="win32"))
    assert decision.kind == "Mirrored"
    assert decision.cross_device_ops == "HierarchicalCopyAllReduce"
    assert "win32" in decision.reasons[1]


def test_logical_gpus_sharing_one_physical_gpu_avoid_nccl() -> None:
    decision = decide(_facts(gpus=2, physical_gpus=1))
    assert decision.kind == "Mirrored"
    assert decision.cross_device_ops == "ReductionToOneDevice"
    assert "share 1 physical GPU" in decision.reasons[1]


def test_faked_logical_cpus_mirror_with_reduction_to_one_device() -> None:
    decision = decide(_facts(cpus=4))
    assert (decision.kind, decision.num_replicas) == ("Mirrored", 4)
    assert decision.cross_device_ops == "ReductionToOneDevice"


def test_two_cpu_workers_use_multi_worker_mirrored_with_ring() -> None:
    decision = decide(_facts(cluster=_two_workers()))
    assert decision.kind == "MultiWorkerMirrored"
    assert decision.cross_device_ops == "RING"
    assert decision.devices == ("/device:CPU:0",) and decision.num_replicas == 2
    assert "2 workers" in decision.reasons[0]
    assert "assumed" in decision.reasons[1]  # no device info on other workers


def test_two_gpu_workers_use_nccl() -> None:
    decision = decide(_facts(gpus=2, cluster=_two_workers()))
    assert (decision.kind, decision.cross_device_ops) == ("MultiWorkerMirrored", "NCCL")
    assert decision.num_replicas == 4  # 2 workers x 2 GPUs
    declared = decide(_facts(gpus=2, cluster=_two_workers(), kinds=["GPU", "GPU"]))
    assert declared.cross_device_ops == "NCCL"
    assert any("TFSCALE_WORKER_DEVICE_KINDS" in r for r in declared.reasons)


def test_gpu_workers_without_nccl_use_ring() -> None:
    decision = decide(_facts(gpus=2, platform="win32", cluster=_two_workers()))
    assert decision.cross_device_ops == "RING"
    assert "NCCL is not available" in " ".join(decision.reasons)


def test_mixed_cpu_gpu_cluster_uses_ring_and_one_device_per_worker() -> None:
    gpu_worker = decide(_facts(gpus=4, cluster=_two_workers(0), kinds=["GPU", "CPU"]))
    assert gpu_worker.cross_device_ops == "RING"
    assert gpu_worker.devices == ("/device:GPU:0",) and gpu_worker.num_replicas == 2
    assert "mix CPU and GPU" in " ".join(gpu_worker.reasons)
    cpu_worker = decide(_facts(gpus=0, cluster=_two_workers(1), kinds=["GPU", "CPU"]))
    assert cpu_worker.cross_device_ops == "RING"
    assert cpu_worker.devices == ("/device:CPU:0",) and cpu_worker.num_replicas == 2
    with pytest.raises(tfscale.DeviceConfigError, match="one GPU only"):
        decide(_facts(gpus=4, cluster=_two_workers(0), kinds=["GPU", "CPU"]), ["GPU:0", "GPU:1"])


def test_declared_kind_contradicting_this_worker_is_an_error() -> None:
    with pytest.raises(tfscale.ClusterConfigError, match="sees CPU devices only"):
        decide(_facts(gpus=0, cluster=_two_workers(0), kinds=["GPU", "GPU"]))


def test_parameter_servers_and_evaluator() -> None:
    ps = parse_tf_config(tf_config(["a:1", "b:2"], 0, ps=["p:3"]))
    with pytest.raises(tfscale.StrategyError, match="ParameterServerStrategy"):
        decide(_facts(cluster=ps))
    chief = parse_tf_config(tf_config(["a:1"], 0, task_type="chief", chief="c:9", ps=["p:3"]))
    assert decide(_facts(cluster=chief)).kind == "ParameterServer"
    raw = json.dumps(
        {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "evaluator", "index": 0}}
    )
    evaluator = decide(_facts(gpus=1, cluster=parse_tf_config(raw)))
    assert evaluator.kind == "OneDevice" and "evaluator" in evaluator.reasons[0]


def test_devices_argument_is_validated() -> None:
    facts = _facts(gpus=2, cpus=1)
    picked = decide(facts, ["gpu:1"])
    assert (picked.kind, picked.devices) == ("OneDevice", ("/device:GPU:1",))
    with pytest.raises(tfscale.DeviceConfigError, match="GPU:7") as info:
        decide(facts, ["GPU:0", "GPU:7"])
    assert "/device:GPU:0, /device:GPU:1, /device:CPU:0" in str(info.value)
    with pytest.raises(tfscale.DeviceConfigError, match="twice"):
        decide(facts, ["GPU:0", "/device:GPU:0"])
    with pytest.raises(tfscale.DeviceConfigError, match="empty"):
        decide(facts, [])
    with pytest.raises(tfscale.DeviceConfigError, match="Not a device name"):
        decide(facts, ["fast-one"])
    # A count is not a list of names (it was a bare TypeError: 'int' object is not iterable).
    with pytest.raises(tfscale.DeviceConfigError, match=r"devices=3") as info:
        decide(facts, 3)  # type: ignore[arg-type]
    assert "devices=['GPU:0', 'GPU:1']" in str(info.value)
    cluster = _facts(gpus=2, cluster=_two_workers())
    assert decide(cluster, ["GPU:0"]).num_replicas == 2
    with pytest.raises(tfscale.DeviceConfigError, match="CUDA_VISIBLE_DEVICES"):
        decide(cluster, ["GPU:1"])


@pytest.mark.tf
def test_remedies_for_the_usual_build_failures() -> None:
    from tfscale.strategy.build import START_TIMEOUT_ENV, remedy, start_timeout_s

    late = RuntimeError("Collective ops must be configured at program startup")
    assert "call choose_strategy() first" in remedy(late)
    assert "TFSCALE_WORKER_START_TIMEOUT" in remedy(
        RuntimeError("Id: [Init]Wait_for_all_tasks_to_register")
    )
    assert remedy(ValueError("something else")) == ""
    assert start_timeout_s({}) == 300.0 and start_timeout_s({START_TIMEOUT_ENV: "2.5"}) == 2.5
    for bad in ("0", "soon"):
        with pytest.raises(tfscale.StrategyError, match=START_TIMEOUT_ENV):
            start_timeout_s({START_TIMEOUT_ENV: bad})


def test_normalize_device() -> None:
    for name in (
        "gpu:1",
        "/GPU:1",
        "/device:GPU:1",
        "/job:localhost/replica:0/task:0/device:GPU:1",
    ):
        assert normalize_device(name) == "/device:GPU:1"


@dataclass(frozen=True)
class _FakeGpu:
    name: str


@pytest.mark.tf
def test_memory_growth_reports_success_late_runtime_and_virtual_gpus() -> None:
    from tfscale.strategy.build import apply_memory_growth

    gpus = [_FakeGpu(f"/physical_device:GPU:{i}") for i in range(3)]
    calls: list[str] = []

    def setter(gpu: _FakeGpu, enable: bool) -> None:
        calls.append(gpu.name)
        if gpu.name.endswith("1"):
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        if gpu.name.endswith("2"):
            raise ValueError("Cannot set memory growth on device when virtual devices configured")

    reasons = apply_memory_growth(gpus, setter)
    assert len(calls) == 3
    assert "Memory growth is on for 1 GPU(s)" in reasons[0]
    assert "GPU:1" in reasons[1] and "already started" in reasons[1]
    assert "GPU:2" in reasons[2] and "logical devices" in reasons[2]


# ---------------------------------------------------------------- real, this process


@pytest.mark.tf
def test_real_facts_see_four_logical_cpus() -> None:
    facts = gather_facts({})
    assert facts.cpus == tuple(f"/device:CPU:{i}" for i in range(4))
    assert facts.gpus == () and facts.physical_gpus == 0 and facts.cluster is None


@pytest.mark.tf
def test_real_choice_mirrors_over_four_logical_cpus() -> None:
    import tensorflow as tf

    choice = tfscale.choose_strategy()
    assert isinstance(choice.strategy, tf.distribute.MirroredStrategy)
    assert (choice.kind, choice.num_replicas) == ("Mirrored", 4)
    assert choice.cross_device_ops == "ReductionToOneDevice"
    assert choice.fallback_error is None
    assert "4 logical CPU devices" in choice.explain()
    ids = choice.strategy.run(
        lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
    )
    assert float(choice.strategy.reduce("SUM", ids, axis=None)) == 0 + 1 + 2 + 3


@pytest.mark.tf
def test_real_choice_restricted_to_two_and_to_one_device() -> None:
    import tensorflow as tf

    two = tfscale.choose_strategy(devices=["/device:CPU:0", "CPU:1"])
    assert (two.kind, two.num_replicas) == ("Mirrored", 2)
    assert two.strategy.extended.worker_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:1",
    )
    one = tfscale.choose_strategy(devices=["CPU:2"])
    assert isinstance(one.strategy, tf.distribute.OneDeviceStrategy)
    assert (one.kind, one.devices, one.num_replicas) == ("OneDevice", ("/device:CPU:2",), 1)
    with pytest.raises(tfscale.DeviceConfigError, match="/device:CPU:3"):
        tfscale.choose_strategy(devices=["GPU:0"])


@pytest.mark.tf
def test_malformed_tf_config_raises_instead_of_falling_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}',
    )
    with pytest.raises(tfscale.ClusterConfigError, match=r"cluster\.worker"):
        tfscale.choose_strategy()


# ---------------------------------------------------------------- real, child processes


_FALLBACK_CHILD = """
import json, os, socket, warnings
taken = socket.socket()
taken.bind(("", 0))  # this worker's own port is already in use: its gRPC server cannot start
taken.listen(1)
other = int(os.environ["OTHER_PORT"])  # the peer never starts
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": [f"127.0.0.1:{taken.getsockname()[1]}", f"127.0.0.1:{other}"]},
    "task": {"type": "worker", "index": 0},
})
import tensorflow as tf
import tfscale

def attempt(**kwargs):
    import tensorflow as tf

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            choice = tfscale.choose_strategy(**kwargs)
        except tfscale.StrategyError as error:
            return {"raised": type(error.__cause__).__name__, "message": str(error)}
    value = float(choice.strategy.run(lambda: tf.constant(2.0) * 3.0))  # the strategy runs
    return {"kind": choice.kind, "error": type(choice.fallback_error).__name__,
            "reasons": choice.reasons, "value": value,
            "warnings": [type(w.message).__name__ for w in caught]}

out = {"strict": attempt(strict=True)}
taken.close()  # now the server starts, but the peer never registers
os.environ["TFSCALE_WORKER_START_TIMEOUT"] = "3"
out["absent_peer"] = attempt()
print("RESULT " + json.dumps(out))
"""


def _result(stdout: str) -> dict[str, object]:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout
    value: dict[str, object] = json.loads(lines[-1][len("RESULT ") :])
    return value


@pytest.mark.multiprocess
def test_real_construction_failures_fall_back_and_strict_raises() -> None:
    """Two real ways MultiWorkerMirroredStrategy fails to build, in one child process."""
    result = run_python(_FALLBACK_CHILD, env={"OTHER_PORT": str(free_ports(1)[0])}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out: dict[str, Any] = _result(result.stdout)
    strict = out["strict"]
    assert strict["raised"] == "UnknownError"
    assert "Could not start gRPC server" in strict["message"] and "port" in strict["message"]
    fallback = out["absent_peer"]
    assert fallback["kind"] == "OneDevice" and fallback["error"] == "DeadlineExceededError"
    assert fallback["warnings"] == ["TfscaleWarning"]
    assert "fell back to OneDeviceStrategy" in fallback["reasons"][-1]
    assert "started in time" in fallback["reasons"][-1]
    assert "3 s to start" in fallback["reasons"][-2]
    assert fallback["value"] == 6.0


_WORKER_CHILD = """
import json, tfscale, tensorflow as tf
choice = tfscale.choose_strategy(strict=True)
task = choice.cluster.task_index
def step():
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    return ctx.all_reduce("SUM", tf.constant(float(task + 1)))
total = choice.strategy.experimental_local_results(choice.strategy.run(step))[0]
print("RESULT " + json.dumps({"kind": choice.kind, "replicas": choice.num_replicas,
                              "ops": choice.cross_device_ops, "sum": float(total),
                              "declared": any("CPU, CPU" in r for r in choice.reasons)}))
"""


@pytest.mark.multiprocess
# make test resolves the same strategy in the 2 workers `tfscale launch` starts
# (tests/launch/data/elastic_train.py: choose_strategy) and trains them to the uninterrupted
# run's weights; this pair of children adds the ops and the declared devices.
@pytest.mark.full(
    "tests/launch/test_elastic_jobs.py::"
    "test_job_losing_worker_2_finishes_on_2_with_the_uninterrupted_weights[arrays]",
)
def test_real_two_worker_multi_worker_mirrored() -> None:
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]

    def worker(index: int) -> dict[str, object]:
        env = {
            "TF_CONFIG": tf_config(workers, index),
            "TFSCALE_WORKER_DEVICE_KINDS": "CPU,CPU",  # as the launcher declares them
            "TFSCALE_WORKER_START_TIMEOUT": "60",  # a lost peer fails in 60 s, not 300
        }
        result = run_python(_WORKER_CHILD, env=env, timeout=150)
        assert result.returncode == 0, result.stderr[-3000:]
        return _result(result.stdout)

    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(worker, [0, 1]))
    for out in outs:
        assert out == {
            "kind": "MultiWorkerMirrored",
            "replicas": 2,
            "ops": "RING",
            "sum": 3.0,  # 1 + 2: each worker's value, all-reduced across the processes
            "declared": True,
        }
