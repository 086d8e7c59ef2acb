"""The doctor's checks: pure functions of a :class:`~tfscale.doctor.snapshot.Snapshot`.

Each check answers one question about why TensorFlow may not use every GPU and returns a
:class:`CheckResult`: ``ok`` when all is well or the question does not apply, ``warn`` when
something works but not as well as it could, ``fail`` when GPUs go unused or training is
wrong. Every non-ok result carries a remedy. :data:`CHECKS` lists them in report order.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tfscale.devices.visible import parse_visible_devices
from tfscale.doctor.snapshot import Snapshot

__all__ = [
    "CHECKS",
    "CheckResult",
    "check_cpu_only_build",
    "check_cuda_libraries",
    "check_cuda_visible_devices",
    "check_gpu_visibility",
    "check_keras_version",
    "check_nccl",
    "check_strategy",
    "check_tensorflow",
    "check_tf_config",
    "check_xla",
    "run_checks",
]

_GPU_WHEEL = 'pip uninstall -y tensorflow-cpu; pip install "tensorflow[and-cuda]"'
_MIN_KERAS = (3, 10)  # pyproject.toml's lower bound (tests/test_versions.py)


@dataclass(frozen=True)
class CheckResult:
    """The verdict of one check.

    Attributes:
        name: Short identifier, e.g. ``cpu-only-build``.
        status: ``"ok"``, ``"warn"`` or ``"fail"``.
        message: What was found, with the numbers.
        remedy: What to do about it; empty when the status is ok.
    """

    name: str
    status: str
    message: str
    remedy: str = ""


def _ok(name: str, message: str) -> CheckResult:
    return CheckResult(name, "ok", message)


def _major(version: str | None) -> int | None:
    match = re.match(r"\s*(\d+)", version or "")
    return int(match.group(1)) if match else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _gpu_names(snapshot: Snapshot) -> str:
    names = sorted({g.name for g in snapshot.driver_gpus})
    return ", ".join(names)


def _driver_known(snapshot: Snapshot) -> bool:
    return snapshot.driver_source is not None


def check_tensorflow(snapshot: Snapshot) -> CheckResult:
    """TensorFlow imports, and only one pip distribution provides it."""
    name = "tensorflow"
    if snapshot.tensorflow_version is None:
        return CheckResult(
            name,
            "fail",
            f"TensorFlow cannot be imported: {snapshot.errors.get('tensorflow', 'unknown')}",
            'pip install "tensorflow[and-cuda]" (Linux with NVIDIA GPUs) or '
            "pip install tensorflow-cpu",
        )
    installed = snapshot.tensorflow_distributions
    if len(installed) > 1:
        return CheckResult(
            name,
            "warn",
            f"{len(installed)} TensorFlow distributions are installed ({', '.join(installed)}); "
            "they overwrite each other's files and the last one installed wins",
            "pip uninstall -y " + " ".join(d.split("==")[0] for d in installed) + "; "
            'pip install "tensorflow[and-cuda]"',
        )
    return _ok(name, f"TensorFlow {snapshot.tensorflow_version} ({', '.join(installed) or '?'})")


def check_cpu_only_build(snapshot: Snapshot) -> CheckResult:
    """Fails when TensorFlow is a CPU-only build while the driver sees GPUs."""
    name = "cpu-only-build"
    gpus = len(snapshot.driver_gpus)
    if snapshot.is_cuda_build is None:
        return _ok(name, "not applicable: TensorFlow's build information is unknown")
    if snapshot.is_cuda_build:
        return _ok(name, f"TensorFlow is a CUDA build (CUDA {snapshot.cuda_build_version})")
    if gpus == 0:
        return _ok(name, "TensorFlow is a CPU-only build and the driver sees no GPU")
    installed = ", ".join(snapshot.tensorflow_distributions) or "unknown"
    message = (
        f"TensorFlow {snapshot.tensorflow_version} is a CPU-only build ({installed}) "
        f"but the driver sees {gpus} GPU(s) ({_gpu_names(snapshot)}): none can be used"
    )
    if snapshot.system == "Windows":
        remedy = (
            "TensorFlow >= 2.11 has no CUDA build for native Windows: run it in WSL2 and "
            'there `pip install "tensorflow[and-cuda]"`'
        )
    else:
        remedy = _GPU_WHEEL
    return CheckResult(name, "fail", message, remedy)


def check_cuda_visible_devices(snapshot: Snapshot) -> CheckResult:
    """CUDA_VISIBLE_DEVICES is unset, or lists existing GPUs in a form CUDA reads."""
    name = "cuda-visible-devices"
    raw = snapshot.cuda_visible_devices
    if raw is None:
        return _ok(name, "unset: CUDA shows every GPU")
    if snapshot.driver_source == "none":
        return _ok(name, f"CUDA_VISIBLE_DEVICES={raw!r}; not applicable: no NVIDIA driver")
    visible = parse_visible_devices(raw, snapshot.driver_gpus, driver_known=_driver_known(snapshot))
    count = len(snapshot.driver_gpus)
    if not visible.problems:
        shown = "?" if visible.indices is None else len(visible.indices)
        total = count if _driver_known(snapshot) else "?"
        return _ok(name, f"CUDA_VISIBLE_DEVICES={raw!r} shows {shown} of {total} GPU(s)")
    status = "fail" if any(s == "fail" for s, _ in visible.problems) else "warn"
    problems = "; ".join(text for _, text in visible.problems)
    example = ",".join(str(i) for i in range(count)) if count else "0"
    return CheckResult(
        name,
        status,
        f"CUDA_VISIBLE_DEVICES={raw!r} {problems}",
        f"export CUDA_VISIBLE_DEVICES={example} (indices 0-{max(count - 1, 0)} or UUIDs from "
        "`nvidia-smi -L`), or `unset CUDA_VISIBLE_DEVICES` to show every GPU",
    )


def _library_problems(snapshot: Snapshot) -> list[str]:
    problems = []
    wanted = (
        ("cudart", "CUDA runtime", snapshot.cuda_build_version),
        ("cudnn", "cuDNN", snapshot.cudnn_build_version),
    )
    for library, label, built in wanted:
        major = _major(built)
        if major is None:
            continue
        found = [lib for lib in snapshot.cuda_libraries if lib.name == library]
        if any(lib.major == major for lib in found):
            continue
        if found:
            seen = ", ".join(f"{lib.version} ({lib.path})" for lib in found)
            problems.append(
                f"TensorFlow was built for {label} {built} but only lib{library} {seen} "
                f"is installed (major {major} needed)"
            )
        else:
            problems.append(
                f"TensorFlow was built for {label} {built} and no lib{library}.so.{major} was found"
            )
    driver_major = _major(snapshot.cuda_driver_version)
    build_major = _major(snapshot.cuda_build_version)
    if driver_major is not None and build_major is not None and driver_major < build_major:
        problems.append(
            f"the NVIDIA driver {snapshot.driver_version} supports CUDA up to "
            f"{snapshot.cuda_driver_version}, older than the CUDA {snapshot.cuda_build_version} "
            "TensorFlow was built for"
        )
    return problems


def check_cuda_libraries(snapshot: Snapshot) -> CheckResult:
    """The CUDA runtime and cuDNN found (and the driver) match TensorFlow's build (major)."""
    name = "cuda-libraries"
    if not snapshot.is_cuda_build:
        return _ok(name, "not applicable: TensorFlow is not a CUDA build")
    if not snapshot.driver_gpus:
        return _ok(name, "not applicable: the driver sees no GPU")
    if snapshot.system != "Linux":
        # Windows builds name versions differently (cuda_version "64_112"), and the
        # library search reads Linux shared-object names only.
        return _ok(name, f"not checked on {snapshot.system}")
    problems = _library_problems(snapshot)
    if not problems:
        found = ", ".join(f"{lib.name} {lib.version}" for lib in snapshot.cuda_libraries)
        return _ok(name, f"TensorFlow's CUDA and cuDNN majors are installed ({found or 'n/a'})")
    driver_problem = any("NVIDIA driver" in p for p in problems)
    all_seen = len(snapshot.tf_gpus) >= len(snapshot.driver_gpus)
    # TensorFlow loaded every GPU, so it found working libraries somewhere not searched.
    status = "warn" if all_seen and not driver_problem else "fail"
    cuda, cudnn = _major(snapshot.cuda_build_version), _major(snapshot.cudnn_build_version)
    remedy = (
        f'pip install "tensorflow[and-cuda]" (installs CUDA {cuda} and cuDNN {cudnn} as pip '
        f"packages), or put CUDA {cuda} and cuDNN {cudnn} on LD_LIBRARY_PATH"
    )
    if driver_problem:
        remedy = f"upgrade the NVIDIA driver to one supporting CUDA {cuda}; then {remedy}"
    return CheckResult(name, status, "; ".join(problems), remedy)


def _invisibility_causes(snapshot: Snapshot, shown: int | None) -> list[tuple[str, str]]:
    """Likely reasons TensorFlow sees fewer GPUs than the driver, most likely first."""
    causes = []
    if snapshot.is_cuda_build is False:
        causes.append(("build", "TensorFlow is a CPU-only build (see cpu-only-build)"))
    if shown is not None and shown < len(snapshot.driver_gpus):
        causes.append(
            (
                "visible",
                f"CUDA_VISIBLE_DEVICES={snapshot.cuda_visible_devices!r} shows only {shown} "
                "(see cuda-visible-devices)",
            )
        )
    if snapshot.is_cuda_build and snapshot.system == "Linux" and _library_problems(snapshot):
        causes.append(
            ("libraries", "CUDA/cuDNN missing or of the wrong version (see cuda-libraries)")
        )
    if "tf_gpus" in snapshot.errors:
        causes.append(("listing", f"TensorFlow failed listing GPUs: {snapshot.errors['tf_gpus']}"))
    if len(snapshot.tensorflow_distributions) > 1:
        causes.append(
            ("wheels", "several TensorFlow distributions overwrite each other (see tensorflow)")
        )
    causes.append(
        (
            "startup",
            "TensorFlow skipped the GPUs at start-up (compute capability too old, or GPUs in "
            "exclusive-process mode held by another process): TF_CPP_MIN_LOG_LEVEL=0 shows "
            "'Skipping registering GPU devices' with the reason",
        )
    )
    return causes


def check_gpu_visibility(snapshot: Snapshot) -> CheckResult:
    """Fails when the driver sees more GPUs than TensorFlow does, ranking likely causes."""
    name = "gpu-visibility"
    driver, seen = len(snapshot.driver_gpus), len(snapshot.tf_gpus)
    if not _driver_known(snapshot):
        error = snapshot.errors.get("driver", "unknown error")
        return CheckResult(
            name,
            "warn",
            f"TensorFlow sees {seen} GPU(s); the driver could not be read: {error}",
            "check the NVIDIA driver: `nvidia-smi` must list the GPUs",
        )
    if seen >= driver:
        return _ok(name, f"the driver sees {driver} GPU(s) and TensorFlow sees {seen}")
    visible = parse_visible_devices(snapshot.cuda_visible_devices, snapshot.driver_gpus)
    shown = None if visible.indices is None else len(visible.indices)
    causes = _invisibility_causes(snapshot, shown)
    message = f"the driver sees {driver} GPU(s) but TensorFlow sees {seen}"
    keys = {key for key, _ in causes}
    if keys == {"visible", "startup"} and seen == shown and not visible.problems:
        # A valid CUDA_VISIBLE_DEVICES selecting a subset is often deliberate.
        return CheckResult(
            name,
            "warn",
            f"{message}: CUDA_VISIBLE_DEVICES={snapshot.cuda_visible_devices!r} selects them",
            "fine if intended; `unset CUDA_VISIBLE_DEVICES` to use every GPU",
        )
    ranked = "; ".join(f"{i}. {cause}" for i, (_, cause) in enumerate(causes, 1))
    return CheckResult(
        name, "fail", f"{message}. Likely causes: {ranked}", "fix the first cause that applies"
    )


def check_keras_version(snapshot: Snapshot) -> CheckResult:
    """Fails for Keras older than 3.10 (tfscale's lowest supported) or missing."""
    name = "keras-version"
    version = snapshot.keras_version
    remedy = 'pip install -U "keras>=3.10"'
    if version is None:
        error = snapshot.errors.get("keras", "not installed")
        return CheckResult(name, "fail", f"Keras cannot be found: {error}", remedy)
    if _version_tuple(version) < _MIN_KERAS:
        return CheckResult(
            name,
            "fail",
            f"Keras {version} is older than 3.10, tfscale's lowest supported: before 3.8 "
            "losses are scaled wrongly across replicas (wrong gradients), before 3.10 metric "
            "variables are not per replica (History differs from one device's)",
            remedy,
        )
    return _ok(name, f"Keras {version}")


def check_tf_config(snapshot: Snapshot) -> CheckResult:
    """Fails when TF_CONFIG is set but malformed, with the parser's explanation."""
    name = "tf-config"
    if snapshot.tf_config is None or not snapshot.tf_config.strip():
        return _ok(name, "unset (or empty): a single machine")
    if snapshot.tf_config_error:
        return CheckResult(
            name,
            "fail",
            f"TF_CONFIG is malformed: {snapshot.tf_config_error}",
            "fix the field named above, or `unset TF_CONFIG` to train on this machine alone",
        )
    if "tf_config" in snapshot.errors:
        return CheckResult(
            name,
            "warn",
            f"TF_CONFIG could not be validated: {snapshot.errors['tf_config']}",
            "update tfscale",
        )
    return _ok(name, "TF_CONFIG is well formed")


def check_nccl(snapshot: Snapshot) -> CheckResult:
    """Warns when several GPUs must all-reduce without NCCL."""
    name = "nccl"
    gpus = max(len(snapshot.tf_gpus), len(snapshot.driver_gpus))
    if gpus < 2:
        return _ok(name, f"not applicable: {gpus} GPU(s)")
    if snapshot.nccl_available:
        return _ok(name, f"NCCL all-reduce available for {gpus} GPUs")
    if not snapshot.is_cuda_build:
        return _ok(name, "not applicable until TensorFlow is a CUDA build (see cpu-only-build)")
    why = snapshot.system if snapshot.system != "Linux" else "NCCL missing from this build"
    return CheckResult(
        name,
        "warn",
        f"{gpus} GPUs but no NCCL ({why}): gradients are all-reduced by copies through one "
        "device (HierarchicalCopyAllReduce), which scales worse",
        "use Linux (or WSL2) with tensorflow[and-cuda], whose NCCL all-reduce is built in",
    )


def check_strategy(snapshot: Snapshot) -> CheckResult:
    """Warns when TensorFlow sees several devices but the chosen strategy uses one."""
    name = "strategy"
    choice = snapshot.strategy
    if choice is None:
        why = snapshot.strategy_error or "the strategy probe did not run"
        if snapshot.tf_config_error:
            why = "TF_CONFIG is malformed (see tf-config)"
        return CheckResult(
            name, "warn", f"no strategy could be chosen: {why}", "fix the failures above first"
        )
    collectives = f", {choice.collectives}" if choice.collectives else ""
    summary = f"would pick {choice.kind} with {choice.replicas} replica(s){collectives}"
    reasons = f": {'; '.join(choice.reasons)}" if choice.reasons else ""
    gpus = len(snapshot.tf_gpus)
    if gpus >= 2 and choice.replicas < gpus:
        return CheckResult(
            name,
            "warn",
            f"TensorFlow sees {gpus} GPUs but choose_strategy {summary}{reasons}",
            "pass devices=None to tfscale.choose_strategy, or see its reasons",
        )
    if gpus == 0 and choice.replicas == 1:
        # Nothing is wrong, but a CPU-only machine can still run multi-device code.
        return _ok(
            name,
            f"choose_strategy {summary}{reasons}. To try multi-device training on this CPU: "
            "export TFSCALE_VIRTUAL_DEVICES=2 (2 logical CPU devices, MirroredStrategy)",
        )
    return _ok(name, f"choose_strategy {summary}{reasons}")


def check_xla(snapshot: Snapshot) -> CheckResult:
    """Reports whether XLA is built in, and the ``jit_compile`` pitfall under a strategy."""
    name = "xla"
    if snapshot.xla_available is None:
        return _ok(name, "not applicable: TensorFlow's build is unknown")
    if not snapshot.xla_available:
        return CheckResult(
            name,
            "warn",
            "TensorFlow was built without XLA: jit_compile=True will fail",
            "install an official TensorFlow wheel",
        )
    return _ok(
        name,
        "XLA is built in; under a strategy Keras's jit_compile='auto' turns it off, "
        "pass jit_compile=True to use it",
    )


CHECKS: tuple[Callable[[Snapshot], CheckResult], ...] = (
    check_tensorflow,
    check_cpu_only_build,
    check_cuda_visible_devices,
    check_cuda_libraries,
    check_gpu_visibility,
    check_keras_version,
    check_tf_config,
    check_nccl,
    check_strategy,
    check_xla,
)


def run_checks(snapshot: Snapshot) -> list[CheckResult]:
    """Runs every check of :data:`CHECKS` on ``snapshot`` in order."""
    return [check(snapshot) for check in CHECKS]
