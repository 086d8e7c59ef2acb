"""Each doctor check against a faked snapshot that triggers it and one that passes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tfscale.doctor import checks
from tfscale.doctor.checks import CHECKS, CheckResult, run_checks
from tfscale.doctor.snapshot import Snapshot

from . import fakes

Case = tuple[Callable[[Snapshot], CheckResult], Callable[[], Snapshot], str, str]

# (check, snapshot, expected status, text the message must contain)
CASES: dict[str, Case] = {
    "tensorflow/ok": (checks.check_tensorflow, fakes.four_gpus, "ok", "2.21.0"),
    "tensorflow/missing": (
        checks.check_tensorflow,
        lambda: fakes.cpu_machine(
            tensorflow_version=None, errors={"tensorflow": "ModuleNotFoundError: tensorflow"}
        ),
        "fail",
        "ModuleNotFoundError",
    ),
    "tensorflow/two-wheels": (
        checks.check_tensorflow,
        lambda: fakes.gpu_machine(
            4, tensorflow_distributions=("tensorflow==2.21.0", "tensorflow-cpu==2.21.0")
        ),
        "warn",
        "2 TensorFlow distributions",
    ),
    "cpu-only/ok-gpu-build": (checks.check_cpu_only_build, fakes.four_gpus, "ok", "CUDA build"),
    "cpu-only/ok-no-gpu": (checks.check_cpu_only_build, fakes.zero_gpus, "ok", "no GPU"),
    "cpu-only/fail": (
        checks.check_cpu_only_build,
        fakes.cpu_only_build_with_gpus,
        "fail",
        "CPU-only build (tensorflow-cpu==2.21.0) but the driver sees 4 GPU(s)",
    ),
    "cvd/unset": (checks.check_cuda_visible_devices, fakes.four_gpus, "ok", "unset"),
    "cvd/subset": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("0,2", 2),
        "ok",
        "shows 2 of 4",
    ),
    "cvd/uuid": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("GPU-7c2e3d4f,3", 2),
        "ok",
        "shows 2 of 4",
    ),
    "cvd/empty": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("", 0),
        "fail",
        "hides every GPU",
    ),
    "cvd/minus-one": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("-1", 0),
        "fail",
        "hides every GPU",
    ),
    "cvd/malformed": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("0;1", 0),
        "fail",
        "neither a GPU index nor",
    ),
    "cvd/absent-index": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("0,4,1", 1),
        "fail",
        "names GPU 4 but the driver sees 4 (indices 0-3); CUDA ignores it and every entry",
    ),
    "cvd/unknown-uuid": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("GPU-00000000-dead-beef", 0),
        "fail",
        "which no GPU has",
    ),
    "cvd/duplicate": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("1,1", 1),
        "warn",
        "lists GPU 1 twice",
    ),
    "cvd/mig": (
        checks.check_cuda_visible_devices,
        lambda: fakes.visible_devices("MIG-4a2b1c3d-1111-2222-3333-444455556666", 1),
        "warn",
        "MIG",
    ),
    "cvd/no-driver": (
        checks.check_cuda_visible_devices,
        lambda: fakes.cpu_machine(cuda_visible_devices=""),
        "ok",
        "no NVIDIA driver",
    ),
    "cuda-libs/ok": (checks.check_cuda_libraries, fakes.four_gpus, "ok", "cudart 12"),
    "cuda-libs/cpu-build": (checks.check_cuda_libraries, fakes.zero_gpus, "ok", "not applicable"),
    "cuda-libs/mismatch": (
        checks.check_cuda_libraries,
        fakes.cuda_mismatch,
        "fail",
        "built for CUDA runtime 12.5.1 but only libcudart 11.8.89",
    ),
    "cuda-libs/missing": (
        checks.check_cuda_libraries,
        lambda: fakes.gpu_machine(4, cuda_libraries=(), tf_gpus=()),
        "fail",
        "no libcudnn.so.9 was found",
    ),
    "cuda-libs/missing-but-loaded": (
        checks.check_cuda_libraries,
        lambda: fakes.gpu_machine(4, cuda_libraries=()),
        "warn",
        "no libcudart.so.12",
    ),
    "cuda-libs/old-driver": (
        checks.check_cuda_libraries,
        fakes.old_driver,
        "fail",
        "supports CUDA up to 11.4",
    ),
    "visibility/ok": (checks.check_gpu_visibility, fakes.four_gpus, "ok", "sees 4"),
    "visibility/cpu-build": (
        checks.check_gpu_visibility,
        fakes.cpu_only_build_with_gpus,
        "fail",
        "Likely causes: 1. TensorFlow is a CPU-only build",
    ),
    "visibility/mismatch": (
        checks.check_gpu_visibility,
        fakes.cuda_mismatch,
        "fail",
        "Likely causes: 1. CUDA/cuDNN missing",
    ),
    "visibility/unexplained": (
        checks.check_gpu_visibility,
        lambda: fakes.gpu_machine(4, tf_gpus=("/physical_device:GPU:0",)),
        "fail",
        "sees 4 GPU(s) but TensorFlow sees 1. Likely causes: 1. TensorFlow skipped",
    ),
    "visibility/cvd-deliberate": (
        checks.check_gpu_visibility,
        lambda: fakes.visible_devices("0,1", 2),
        "warn",
        "selects them",
    ),
    "visibility/cvd-typo": (
        checks.check_gpu_visibility,
        lambda: fakes.visible_devices("0,5", 1),
        "fail",
        "1. CUDA_VISIBLE_DEVICES='0,5' shows only 1",
    ),
    "visibility/driver-unreadable": (
        checks.check_gpu_visibility,
        lambda: fakes.gpu_machine(
            0, driver_source=None, errors={"driver": "RuntimeError: nvidia-smi hung"}
        ),
        "warn",
        "nvidia-smi hung",
    ),
    "keras/ok": (checks.check_keras_version, fakes.four_gpus, "ok", "3.15.1"),
    "keras/old": (checks.check_keras_version, fakes.old_keras, "fail", "3.7.0 is older than 3.10"),
    "keras/two": (
        checks.check_keras_version,
        lambda: fakes.gpu_machine(1, keras_version="2.15.0"),
        "fail",
        "older than 3.10",
    ),
    "tf-config/unset": (checks.check_tf_config, fakes.four_gpus, "ok", "unset"),
    "tf-config/empty": (
        checks.check_tf_config,
        lambda: fakes.gpu_machine(4, tf_config=""),
        "ok",
        "single machine",
    ),
    "tf-config/valid": (
        checks.check_tf_config,
        lambda: fakes.gpu_machine(4, tf_config='{"cluster": {}}'),
        "ok",
        "well formed",
    ),
    "tf-config/broken": (
        checks.check_tf_config,
        fakes.broken_tf_config,
        "fail",
        "task.index is out of range",
    ),
    "nccl/ok": (checks.check_nccl, fakes.four_gpus, "ok", "NCCL all-reduce available"),
    "nccl/one-gpu": (checks.check_nccl, fakes.one_gpu, "ok", "not applicable"),
    "nccl/windows": (checks.check_nccl, fakes.windows_gpus, "warn", "2 GPUs but no NCCL (Windows)"),
    "strategy/ok": (checks.check_strategy, fakes.four_gpus, "ok", "MirroredStrategy with 4"),
    "strategy/one-of-four": (
        checks.check_strategy,
        lambda: fakes.gpu_machine(4, strategy=fakes._strategy(1)),
        "warn",
        "TensorFlow sees 4 GPUs but choose_strategy would pick OneDeviceStrategy",
    ),
    "strategy/cpu-only-machine": (
        checks.check_strategy,
        fakes.zero_gpus,
        "ok",
        "export TFSCALE_VIRTUAL_DEVICES=2",
    ),
    "strategy/broken-tf-config": (
        checks.check_strategy,
        fakes.broken_tf_config,
        "warn",
        "TF_CONFIG is malformed",
    ),
    "xla/ok": (checks.check_xla, fakes.four_gpus, "ok", "jit_compile=True"),
    "xla/absent": (
        checks.check_xla,
        lambda: fakes.gpu_machine(1, xla_available=False),
        "warn",
        "without XLA",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_check(case: str) -> None:
    check, make, status, text = CASES[case]
    result = check(make())
    assert result.status == status, result
    assert text in result.message, result.message
    assert (result.remedy == "") == (status == "ok"), result


def test_every_check_has_a_triggering_and_a_passing_case() -> None:
    statuses: dict[str, set[str]] = {}
    for check, make, _, _ in CASES.values():
        statuses.setdefault(check.__name__, set()).add(check(make()).status)
    for check in CHECKS:
        assert "ok" in statuses[check.__name__], check.__name__
        assert statuses[check.__name__] & {"warn", "fail"}, check.__name__


def test_cpu_only_remedy_installs_the_cuda_wheel() -> None:
    result = checks.check_cpu_only_build(fakes.cpu_only_build_with_gpus())
    assert result.remedy == 'pip uninstall -y tensorflow-cpu; pip install "tensorflow[and-cuda]"'


@pytest.mark.parametrize("scenario", sorted(fakes.SCENARIOS))
def test_scenarios_fail_exactly_where_expected(scenario: str) -> None:
    failing = {r.name for r in run_checks(fakes.SCENARIOS[scenario]()) if r.status == "fail"}
    expected = {
        "zero_gpus": set(),
        "one_gpu": set(),
        "four_gpus": set(),
        "windows_gpus": set(),
        "cpu_only_build_with_gpus": {"cpu-only-build", "gpu-visibility"},
        "cuda_mismatch": {"cuda-libraries", "gpu-visibility"},
        "old_driver": {"cuda-libraries", "gpu-visibility"},
        "broken_tf_config": {"tf-config"},
        "old_keras": {"keras-version"},
    }[scenario]
    assert failing == expected
