"""``tfscale launch``: run a script as a multi-worker job, locally, on Slurm or on Kubernetes.

    tfscale launch -n 2 train.py --epochs 4            # 2 local workers (MultiWorkerMirrored)
    tfscale launch --ps 1 -n 2 train.py                # chief + 2 workers + 1 ps (ParameterServer)
    tfscale launch -n 3 --min-workers 2 --max-restarts 2 train.py   # elastic: may drop a worker
    srun tfscale launch --slurm train.py               # one worker per Slurm task
    tfscale launch --slurm --print-sbatch --nodes 2 --gpus-per-node 4 train.py
    tfscale launch --k8s --workers 4 --image me/train:1 --gpus-per-worker 2 train.py

Imports no TensorFlow: the workers do.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from types import FrameType
from typing import Any

from tfscale.errors import LaunchError, explain

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Adds the ``launch`` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "launch",
        help="run a script as a multi-worker job (local processes, Slurm or a Kubeflow TFJob)",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    local = parser.add_argument_group("local job (default)")
    local.add_argument(
        "-n",
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default 2; with --k8s: worker replicas)",
    )
    local.add_argument(
        "--devices-per-worker",
        type=int,
        default=None,
        metavar="K",
        help="split each worker's CPU (or single GPU) into K logical devices",
    )
    local.add_argument(
        "--port",
        type=int,
        default=None,
        metavar="BASE",
        help="use ports BASE, BASE+1, ... (default: free ports chosen per attempt; "
        "with --slurm: the first port on each node, default 8888)",
    )
    local.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="start the whole job again up to R times after a failure",
    )
    local.add_argument(
        "--min-workers",
        type=int,
        default=None,
        metavar="M",
        help="elastic: a worker that fails on every start until its restarts are used up is "
        "dropped and the job restarts on the others from its checkpoint, down to M workers "
        "(with --slurm: the nodes left in the allocation)",
    )
    local.add_argument(
        "--ps",
        type=int,
        default=0,
        metavar="P",
        help="parameter servers: adds a chief that runs the script, "
        "workers and ps tasks run tf.distribute.Server",
    )
    local.add_argument(
        "--gpus-per-worker",
        type=int,
        default=None,
        metavar="G",
        help="GPUs per worker: each local worker gets its own CUDA_VISIBLE_DEVICES block "
        "(default: the visible GPUs split evenly; 0: CPU only); with --k8s: the "
        "nvidia.com/gpu limit of each worker pod",
    )
    local.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop the whole job after S seconds, restarts included (exit status 124)",
    )
    local.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping workers",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="time every worker's training steps (as tfscale profile does) and write each "
        "worker's part into DIR (a shared folder on a cluster); tfscale profile --merge DIR "
        "then reports per worker and names the straggler",
    )
    slurm = parser.add_argument_group("Slurm")
    slurm.add_argument(
        "--slurm",
        action="store_true",
        help="inside an allocation (one srun task per worker): set TF_CONFIG "
        "from the Slurm environment and run the script",
    )
    slurm.add_argument(
        "--print-sbatch",
        action="store_true",
        help="with --slurm: print an sbatch script for this job and exit",
    )
    # The elastic sbatch loop's decision between two steps (launch/slurm_elastic.py).
    slurm.add_argument("--next-step", default=None, metavar="DIR", help=argparse.SUPPRESS)
    slurm.add_argument("--step-attempt", type=int, default=None, help=argparse.SUPPRESS)
    slurm.add_argument("--nodes", type=int, default=2, help="sbatch --nodes (default 2)")
    slurm.add_argument(
        "--tasks-per-node", type=int, default=1, help="sbatch --ntasks-per-node (default 1)"
    )
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="sbatch --gpus-per-node")
    slurm.add_argument("--time", default="01:00:00", help="sbatch --time (default 01:00:00)")
    k8s = parser.add_argument_group("Kubernetes (Kubeflow TFJob)")
    k8s.add_argument("--k8s", action="store_true", help="write a TFJob manifest and exit")
    k8s.add_argument("--image", default=None, help="container image with TF, tfscale, script")
    k8s.add_argument("--name", default="tfscale-job", help="job name (also sbatch --job-name)")
    k8s.add_argument("--namespace", default=None, help="Kubernetes namespace")
    k8s.add_argument(
        "--restart-policy",
        default="ExitCode",
        help="replica restartPolicy: Always, OnFailure, Never, ExitCode (default)",
    )
    k8s.add_argument("--out", default=None, metavar="FILE", help="write to FILE, not stdout")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(handler=run)


def _refuse(problem: str, received: str, allowed: str, fix: str) -> None:
    raise LaunchError(explain(problem, received=received, allowed=allowed, fix=fix))


def check_options(args: argparse.Namespace) -> None:
    """Refuses contradictory or impossible options before anything starts.

    Raises:
        LaunchError: The first problem found, naming the options.
    """
    if args.slurm and args.k8s:
        _refuse(
            "--slurm and --k8s choose two different ways to run the job.",
            "--slurm --k8s",
            "one of them",
            "run inside a Slurm allocation with --slurm, or write a TFJob with --k8s.",
        )
    if args.print_sbatch and not args.slurm:
        _refuse(
            "--print-sbatch writes a Slurm batch script; without --slurm it would start a "
            "local job instead.",
            "--print-sbatch without --slurm",
            "--slurm --print-sbatch",
            "tfscale launch --slurm --print-sbatch --nodes 2 train.py > job.sbatch",
        )
    if args.port is not None and not 1 <= args.port <= 65535:
        _refuse("--port is not a TCP port.", f"--port {args.port}", "1..65535", "--port 29500")
    if args.min_workers is not None:
        _check_min_workers(args)


def _check_min_workers(args: argparse.Namespace) -> None:
    m = args.min_workers
    if args.ps or args.k8s:
        other = f"--ps {args.ps}" if args.ps else "--k8s"
        _refuse(
            "--min-workers (elastic) drops MultiWorkerMirrored workers; a job with parameter "
            "servers or a TFJob cannot be resized by tfscale.",
            f"--min-workers {m} {other}",
            "--min-workers with a local job (-n N) or --slurm",
            f"drop --min-workers, or drop {other}.",
        )
    if args.slurm:
        workers, option = args.nodes * args.tasks_per_node, "--nodes x --tasks-per-node"
    else:
        workers, option = (2 if args.workers is None else args.workers), "-n"
    if not 1 <= m <= workers:
        _refuse(
            f"--min-workers is the fewest workers the job may finish on; it must be between 1 "
            f"and the job's workers ({option}: {workers}).",
            f"--min-workers {m} with {option} {workers}",
            f"1 <= --min-workers <= {workers}",
            f"--min-workers {max(1, min(m, workers - 1) if workers > 1 else 1)}",
        )
    if args.slurm and m % args.tasks_per_node:
        _refuse(
            "With --slurm, whole nodes are dropped, so --min-workers counts whole nodes' tasks.",
            f"--min-workers {m} with --tasks-per-node {args.tasks_per_node}",
            f"a multiple of --tasks-per-node ({args.tasks_per_node})",
            f"--min-workers {(m // args.tasks_per_node + 1) * args.tasks_per_node}",
        )


def check_script_path(path: str) -> None:
    """Refuses a script that is missing or a folder, before any worker (or restart) starts.

    Raises:
        LaunchError: The path names no file Python can run.
    """
    runnable = os.path.isfile(path) or os.path.isfile(os.path.join(path, "__main__.py"))
    if not runnable:
        what = "is a folder without __main__.py" if os.path.isdir(path) else "does not exist"
        _refuse(
            f"The script {what}, so every worker would fail at once.",
            path,
            "a Python file (or a folder with __main__.py)",
            f"check the path; the working directory is {os.getcwd()}",
        )


def run(args: argparse.Namespace) -> int:
    """Runs the job the options describe; returns the job's exit status."""
    check_options(args)
    script = (args.script, *args.script_args) if args.script else ()
    if args.k8s:
        return _write_tfjob(args, script)
    if args.slurm:
        if args.ps:
            raise LaunchError(
                explain(
                    "tfscale launch --slurm starts MultiWorkerMirrored workers; --ps is not "
                    "supported there.",
                    received=f"--slurm --ps {args.ps}",
                    allowed="--slurm without --ps",
                    fix="use --ps locally or in a TFJob (--k8s --ps P).",
                )
            )
        return _slurm(args, script)
    if script:
        check_script_path(script[0])
    if not script:
        raise LaunchError(
            explain(
                "tfscale launch needs a script to run.",
                received="no script",
                allowed="tfscale launch -n N [options] script.py [args...]",
                fix="name the script after the options.",
            )
        )
    return _local(args, _profiled(args, script))


def _profiled(args: argparse.Namespace, script: tuple[str, ...]) -> tuple[str, ...]:
    """With ``--profile DIR``: each worker runs the script under ``tfscale profile``'s
    timing and writes its part into DIR (``tfscale profile --merge DIR`` reports)."""
    if not getattr(args, "profile", None):
        return script
    from tfscale.profiling.script import profiled_command

    return profiled_command(script, args.profile)


def _local(args: argparse.Namespace, script: tuple[str, ...]) -> int:
    from tfscale.cluster.notes import REPORT_ENV, read_checkpoint_note
    from tfscale.launch.elastic import elastic_line
    from tfscale.launch.local import run_local_job
    from tfscale.launch.plan import LocalJob
    from tfscale.launch.together import NOT_TOGETHER_STATUS, final_line, read_verdicts

    workers = 2 if args.workers is None else args.workers
    job = LocalJob(
        script=script,
        workers=workers,
        ps=args.ps,
        devices_per_worker=args.devices_per_worker,
        gpus_per_worker=args.gpus_per_worker,
    )
    previous = _signals_as_interrupt()
    with tempfile.TemporaryDirectory(prefix="tfscale-launch-") as reports:
        # Where workers that would train alone leave why (launch/together.py).
        env = dict(os.environ, **{REPORT_ENV: reports})
        try:
            result = run_local_job(
                job,
                port_base=args.port,
                max_restarts=args.max_restarts,
                grace_s=args.grace,
                timeout_s=args.timeout,
                base_env=env,
                min_workers=args.min_workers,
            )
        finally:
            for signum, handler in (previous or {}).items():
                signal.signal(signum, handler)
        verdicts = read_verdicts(reports)
        checkpoint = read_checkpoint_note(reports)
    resized = elastic_line(
        workers=workers,
        finished=result.workers if result.exit_code == 0 else None,
        dropped=result.dropped,
        below=result.below,
        min_workers=args.min_workers or workers,
        checkpoint=checkpoint,
    )
    if resized is not None and not verdicts:
        # The job's last line: which worker was dropped, why, how many finished.
        print(f"[tfscale launch] {resized}", file=sys.stderr, flush=True)
    if getattr(args, "profile", None) and not verdicts:
        _merge_profile(args.profile, script)
    if verdicts:
        # The job's last line: it never exits 0 when its workers did not train together.
        print(f"[tfscale launch] {final_line(verdicts)}", file=sys.stderr, flush=True)
        return result.exit_code or NOT_TOGETHER_STATUS
    return result.exit_code


def _merge_profile(directory: str, script: tuple[str, ...]) -> None:
    """A local job's workers all wrote their parts here: the launcher builds the report
    (``tfscale profile --merge DIR`` does the same after a cluster job)."""
    from tfscale.errors import ProfileError
    from tfscale.profiling.report import write_report
    from tfscale.profiling.script import merge_workers, read_workers

    name = script[5] if len(script) > 5 and script[0] == "-m" else directory
    try:
        report = merge_workers(read_workers(directory), name)
    except ProfileError as error:
        print(f"[tfscale launch] no profile report: {error}", file=sys.stderr, flush=True)
        return
    write_report(report, directory)
    straggler = report.straggler
    verdict = (
        f"straggler: worker {straggler.worker}, {straggler.cause}" if straggler else "no straggler"
    )
    print(
        f"[tfscale launch] profile ({verdict}): {os.path.join(directory, 'report.html')}",
        file=sys.stderr,
        flush=True,
    )


def _signals_as_interrupt() -> Any:
    """Makes SIGTERM to the launcher (a scheduler stopping it) stop the workers like Ctrl-C,
    and makes SIGINT do so even when the launcher was started with SIGINT ignored.

    Python installs its KeyboardInterrupt handler only where SIGINT was not ignored at start,
    and a parent's ignored SIGINT is inherited: in two full test runs a launcher started
    from a pytest process in that state ran on for 60 s after SIGINT, while SIGTERM (which
    had its own handler) stopped it. Returns the previous handlers, to restore.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: leave signals alone
        return None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(previous))
    return previous


def _slurm(args: argparse.Namespace, script: tuple[str, ...]) -> int:
    from tfscale.launch.slurm import DEFAULT_SLURM_PORT, exec_slurm_task, sbatch_script

    port = DEFAULT_SLURM_PORT if args.port is None else args.port
    if args.next_step:
        return _next_step(args)
    if args.print_sbatch and getattr(args, "profile", None):
        raise LaunchError(
            explain(
                "--profile applies to the workers srun starts, not to the sbatch script.",
                received=f"--slurm --print-sbatch --profile {args.profile}",
                allowed="--profile on the srun line inside the batch script",
                fix=f"srun tfscale launch --slurm --profile {args.profile} train.py",
            )
        )
    if args.print_sbatch:
        print(
            sbatch_script(
                script,
                nodes=args.nodes,
                tasks_per_node=args.tasks_per_node,
                gpus_per_node=args.gpus_per_node,
                time_limit=args.time,
                job_name=args.name,
                port_base=port,
                max_restarts=args.max_restarts,
                min_workers=args.min_workers,
            ),
            end="",
        )
        return 0
    if not script:
        raise LaunchError(
            explain(
                "tfscale launch --slurm needs a script to run.",
                received="no script",
                allowed="srun tfscale launch --slurm script.py [args...]",
                fix="name the script after the options.",
            )
        )
    exec_slurm_task(_profiled(args, script), os.environ, port_base=port)


def _next_step(args: argparse.Namespace) -> int:
    from tfscale.cluster.notes import REPORT_ENV
    from tfscale.launch.slurm_elastic import next_step

    status, options, line = next_step(
        args.next_step,
        attempt=args.step_attempt,
        max_restarts=args.max_restarts,
        min_workers=args.min_workers or 1,
        tasks_per_node=args.tasks_per_node,
        report_dir=os.environ.get(REPORT_ENV),
        env=os.environ,
    )
    if line:
        print(line, file=sys.stderr, flush=True)
    if options:
        print(options)
    return status


def _write_tfjob(args: argparse.Namespace, script: tuple[str, ...]) -> int:
    from tfscale.launch.k8s import tfjob_manifest
    from tfscale.launch.yamltext import to_yaml

    if not args.image or not script:
        raise LaunchError(
            explain(
                "tfscale launch --k8s needs --image and a script.",
                received=f"--image {args.image!r}, script {' '.join(script) or None!r}",
                allowed="tfscale launch --k8s --workers N --image IMAGE script.py [args...]",
                fix="name the container image that holds TensorFlow, tfscale and the script.",
            )
        )
    manifest = tfjob_manifest(
        name=args.name,
        image=args.image,
        command=("python", *script),
        workers=2 if args.workers is None else args.workers,
        gpus_per_worker=args.gpus_per_worker or 0,
        ps=args.ps,
        restart_policy=args.restart_policy,
        backoff_limit=args.max_restarts,
        namespace=args.namespace,
    )
    text = to_yaml(manifest)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(f"wrote {args.out}; submit it with: kubectl apply -f {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
