"""``tfscale doctor --script train.py [args...]``: find variables built outside the scope.

The user's script runs as ``__main__`` in a child process (its own TensorFlow runtime,
bounded by a timeout, killed with its process group, dying with this process) under the
instrumentation of :mod:`tfscale.doctor.instrument`, which appends events to a JSON-lines
file. Running the script is :mod:`tfscale.processes.script_runner`'s, shared with
``tfscale profile``.
This parent imports no TensorFlow: it reads the events, gathers them into one frozen
:class:`ScriptFindings` (:func:`summarize`, a pure function), and prints a table or JSON.

Exit status: the script's own status when it failed, else 1 when variables were created
outside the scope of a multi-replica strategy, a custom loop built its model or optimizer
inside ``strategy.run``, or a custom loop's update is N times one device's, else 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from tfscale.doctor.report import make_console
from tfscale.interop.internals import DEFAULT_STRATEGY_CLASS
from tfscale.processes.script_runner import check_script, run_in_child

__all__ = [
    "RunSeen",
    "ScriptFindings",
    "StrategySeen",
    "VariableGroup",
    "read_events",
    "render",
    "run_script",
    "summarize",
]

_STDERR_TAIL_LINES = 25
_SHOWN_NAMES = 3


@dataclass(frozen=True)
class StrategySeen:
    """A strategy the script constructed.

    Attributes:
        kind: Class name, e.g. ``MirroredStrategy``.
        replicas: ``num_replicas_in_sync``.
        devices: Its worker devices.
        created_at: Where it was constructed (``file:line in function``, innermost first).
        replica_devices: The device each replica's step ran on, from the first step it
            ran; empty when it never ran a step.
    """

    kind: str
    replicas: int
    devices: tuple[str, ...]
    created_at: tuple[str, ...]
    replica_devices: tuple[str, ...]


@dataclass(frozen=True)
class RunSeen:
    """Steps that ran outside any strategy scope (on TensorFlow's default strategy)."""

    called_at: tuple[str, ...]
    replica_devices: tuple[str, ...]


@dataclass(frozen=True)
class VariableGroup:
    """Variables created at one place under one strategy.

    Attributes:
        created_at: ``file:line in function`` frames of the user's code, innermost first.
        strategy: Class name of the strategy whose scope was active, or None (no scope).
        replicas: Replicas of that strategy (1 for none).
        count: Variables (a mirrored variable counts once, not once per device).
        trainable: How many of them are trainable.
        devices: Devices their copies live on.
        names: The first few variable names.
        repaired_by: What moved them into a strategy's scope before training
            (``"tfscale.fix_scope at train.py:20"``), or None.
    """

    created_at: tuple[str, ...]
    strategy: str | None
    replicas: int
    count: int
    trainable: int
    devices: tuple[str, ...]
    names: tuple[str, ...]
    repaired_by: str | None = None


@dataclass(frozen=True)
class ScriptFindings:
    """Everything ``doctor --script`` learned from one run of a script."""

    script: str
    args: tuple[str, ...]
    exit_status: int | None
    timed_out: bool
    virtual_devices: str | None
    devices_set_by_doctor: bool
    strategies: tuple[StrategySeen, ...]
    default_runs: tuple[RunSeen, ...]
    variables: tuple[VariableGroup, ...]
    problems: tuple[str, ...]
    stderr_tail: str
    data_problems: tuple[str, ...] = ()
    loop_problems: tuple[str, ...] = ()

    @property
    def crashed(self) -> bool:
        """The script ended with a non-zero status (not counting a timeout)."""
        return not self.timed_out and self.exit_status not in (0, None)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads the instrumentation's JSON lines; a last line cut by a kill is skipped."""
    events: list[dict[str, Any]] = []
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _site(stack: Sequence[str], joiner: str = ", called from ") -> str:
    """``a.py:3 in f, called from b.py:9`` (pure); module level frames drop ``in <module>``."""
    if not stack:
        return "(unknown: created inside a library)"
    first = stack[0].removesuffix(" in <module>")
    callers = ", ".join(frame.rsplit(" in ", 1)[0] for frame in stack[1:3])
    return first + (f"{joiner}{callers}" if callers else "")


def _repairs(events: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """``{index of a variable event: what repaired it}`` (pure).

    A ``repaired`` event names variables by ``id``; it covers the variable events logged
    before it only (an id can be reused by a variable created after the repair).
    """
    latest: dict[int, int] = {}  # id -> index of its latest variable event so far
    out: dict[int, str] = {}
    for index, event in enumerate(events):
        if event.get("kind") == "variable" and "id" in event:
            latest[int(event["id"])] = index
        elif event.get("kind") == "repaired":
            where = _site(tuple(event.get("stack") or ()))
            for ident in event.get("ids") or ():
                if int(ident) in latest:
                    out[latest.pop(int(ident))] = f"{event.get('how')} at {where}"
    return out


def _group_variables(events: Sequence[Mapping[str, Any]]) -> tuple[VariableGroup, ...]:
    groups: dict[tuple[tuple[str, ...], str | None, int, str | None], dict[str, Any]] = {}
    repairs = _repairs(events)
    for index, event in enumerate(events):
        if event.get("kind") != "variable":
            continue
        key = (
            tuple(event.get("stack") or ()),
            event.get("strategy"),
            int(event["replicas"]),
            repairs.get(index),
        )
        group = groups.setdefault(key, {"count": 0, "trainable": 0, "devices": {}, "names": []})
        group["devices"][event.get("device") or "?"] = None
        if event.get("copy"):
            continue  # a mirrored variable's copy on another device: counted once
        group["count"] += 1
        group["trainable"] += bool(event.get("trainable"))
        if len(group["names"]) < _SHOWN_NAMES:
            group["names"].append(str(event.get("name", "")).removesuffix(":0"))
    return tuple(
        VariableGroup(
            created_at=stack,
            strategy=strategy,
            replicas=replicas,
            count=g["count"],
            trainable=g["trainable"],
            devices=tuple(g["devices"]),
            names=tuple(g["names"]),
            repaired_by=repaired_by,
        )
        for (stack, strategy, replicas, repaired_by), g in groups.items()
    )


def _strategies(events: Sequence[Mapping[str, Any]]) -> tuple[StrategySeen, ...]:
    ran: dict[int, tuple[str, ...]] = {}
    for event in events:
        if event.get("kind") == "run" and event["strategy_id"] not in ran:
            ran[event["strategy_id"]] = tuple(event.get("replica_devices") or ())
    return tuple(
        StrategySeen(
            kind=e["strategy"],
            replicas=int(e["replicas"]),
            devices=tuple(e.get("devices") or ()),
            created_at=tuple(e.get("stack") or ()),
            replica_devices=ran.get(e["strategy_id"], ()),
        )
        for e in events
        if e.get("kind") == "strategy"
    )


def _default_runs(events: Sequence[Mapping[str, Any]]) -> tuple[RunSeen, ...]:
    return tuple(
        RunSeen(tuple(e.get("stack") or ()), tuple(e.get("replica_devices") or ()))
        for e in events
        if e.get("kind") == "run" and e.get("strategy") == DEFAULT_STRATEGY_CLASS
    )


def _problems(
    strategies: Sequence[StrategySeen], groups: Sequence[VariableGroup]
) -> tuple[str, ...]:
    """One sentence per place that created variables outside a multi-replica scope (pure)."""
    multi = [s for s in strategies if s.replicas > 1]
    if not multi:
        return ()
    target = multi[0]
    where = target.created_at[0].rsplit(" in ", 1)[0] if target.created_at else "?"
    problems = []
    for group in groups:
        if group.strategy is not None or group.count == 0 or group.repaired_by:
            continue
        names = ", ".join(group.names) + (" ..." if group.count > len(group.names) else "")
        problems.append(
            f"{group.count} variables ({group.trainable} trainable: {names}) were created "
            f"outside the scope of {target.kind} ({target.replicas} replicas, created at "
            f"{where}) at {_site(group.created_at)}; they live on "
            f"{', '.join(group.devices)} only."
        )
    return tuple(problems)


def _data_problems(events: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """One sentence per ``model.fit`` site that reads a generator or PyDataset under
    several replicas without tfscale's copy (pure; see ``training/data.copied_batches``)."""
    problems: dict[str, str] = {}
    for event in events:
        if event.get("kind") != "fit" or event.get("copied") or int(event["replicas"]) < 2:
            continue
        site = _site(event.get("stack") or ())
        inputs = " and ".join(
            f"a {kind} ({'training' if name == 'x' else 'validation'} data)"
            for name, kind in event["inputs"].items()
        )
        problems.setdefault(
            site,
            f"model.fit at {site} reads {inputs} under {event['strategy']} "
            f"({event['replicas']} replicas): TensorFlow can write into the arrays it returns "
            "(from_generator aliases 64-byte-aligned numpy memory and the loss reuses the "
            "first replica's share), so your data changes and later epochs train on it.",
        )
    return tuple(problems.values())


def _built_in_steps(events: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """One sentence per place where a replica step created variables (pure): a model or an
    optimizer built lazily inside ``strategy.run`` in a ``tf.function``."""
    sites: dict[str, list[str]] = {}
    for event in events:
        if (
            event.get("kind") != "variable"
            or not event.get("in_step")
            or int(event.get("replicas") or 1) < 2
            or event.get("copy")
        ):
            continue
        names = sites.setdefault(_site(event.get("stack") or ()), [])
        names.append(str(event.get("name", "")).removesuffix(":0"))
    problems = []
    for site, names in sites.items():
        shown = ", ".join(names[:_SHOWN_NAMES]) + (" ..." if len(names) > _SHOWN_NAMES else "")
        problems.append(
            f"{len(names)} variables ({shown}) were created inside strategy.run, by the "
            f"replica step traced in a tf.function, at {site}: Keras builds a model on its "
            "first call and an optimizer on its first apply_gradients. Created there, they "
            "are initialized through a cond around the whole step, which fails under the "
            "collective all-reduce (MultiWorkerMirroredStrategy; MirroredStrategy on CPUs): "
            "\"You must feed a value for placeholder tensor 'cond/.../Placeholder_1'\"."
        )
    return tuple(problems)


def _loop_losses(events: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """One sentence per custom loop whose update is N times one device's (pure): its loss
    is a per-replica mean and Keras's optimizer sums the replicas' gradients."""
    problems = []
    for event in events:
        if event.get("kind") != "loop_loss":
            continue
        kinds = list(event.get("kinds") or ())
        if not kinds or any(kind != "MEAN" for kind in kinds):
            continue  # one device's (a vector, a Keras Loss, compute_average_loss) or unknown
        replicas = int(event["replicas"])
        problems.append(
            f"The custom loop's tape.gradient at {_site(event.get('stack') or ())} "
            f"differentiates {' + '.join(event.get('terms') or ())}, a mean over each "
            f"replica's examples, and Keras's optimizer sums the {replicas} replicas' "
            f"gradients: each update is {replicas} times one device's on the same global "
            "batch (with SGD the weights move that much further), with no error."
        )
    return tuple(problems)


def summarize(
    events: Sequence[Mapping[str, Any]],
    *,
    script: str,
    args: Sequence[str] = (),
    exit_status: int | None,
    timed_out: bool = False,
    stderr_tail: str = "",
) -> ScriptFindings:
    """Gathers the instrumentation's events into findings and judges them (pure).

    Args:
        events: Events from :func:`read_events`.
        script: The script's path as given.
        args: Its arguments.
        exit_status: The child's exit status (None when it was killed by a timeout).
        timed_out: The script ran past the timeout and was stopped.
        stderr_tail: The last lines the script wrote to stderr.

    Returns:
        The findings; ``problems`` is non-empty when variables were created outside the
        scope of a multi-replica strategy the script constructed.
    """
    devices = next((e for e in events if e.get("kind") == "devices"), {})
    strategies = _strategies(events)
    groups = _group_variables(events)
    return ScriptFindings(
        script=script,
        args=tuple(args),
        exit_status=exit_status,
        timed_out=timed_out,
        virtual_devices=devices.get("virtual"),
        devices_set_by_doctor=bool(devices.get("set_by_doctor")),
        strategies=strategies,
        default_runs=_default_runs(events),
        variables=groups,
        problems=_problems(strategies, groups),
        stderr_tail=stderr_tail,
        data_problems=_data_problems(events),
        loop_problems=_built_in_steps(events) + _loop_losses(events),
    )


def exit_status(findings: ScriptFindings) -> int:
    """The script's own status when it failed, else 1 with problems, else 0."""
    found = findings.problems or findings.data_problems or findings.loop_problems
    if findings.crashed:
        status = int(findings.exit_status or 1)
        return 128 - status if status < 0 else status  # killed by a signal
    return 1 if found else 0


_FIX = (
    "Build (and compile) the model inside the strategy's scope:\n"
    "    strategy = tf.distribute.MirroredStrategy()\n"
    "    with strategy.scope():\n"
    "        model = build_model()\n"
    "        model.compile(...)\n"
    "(a saved model: model = keras.models.load_model(path) inside the scope), "
    "or repair a built model with model = tfscale.fix_scope(model, strategy), "
    "or train it with tfscale.fit(model, ...), which moves it in."
)
_LOOP_FIX = (
    "add one line after the model and its optimizer are created:\n"
    "    tfscale.prepare_loop(model, optimizer)\n"
    "which builds them in the strategy's scope and makes each update the one a single "
    "device makes on the global batch; or build them in the scope yourself "
    "(with strategy.scope(): model.build(input_shape); "
    "optimizer.build(model.trainable_variables)) and compute the loss with "
    "tf.nn.compute_average_loss(per_example_loss)."
)
_DATA_FIX = (
    "let tfscale copy each batch: model = tfscale.prepare(model) before model.fit, or "
    "tfscale.fit(model, ...); or return copies from the generator (np.array(part)), or use "
    "tf.data."
)


def _strategy_table(findings: ScriptFindings) -> Table:
    table = Table(title="Strategies and where each replica ran", title_justify="left")
    table.add_column("strategy")
    table.add_column("created at", overflow="fold")
    table.add_column("replicas", justify="right")
    table.add_column("replica: device it ran on", overflow="fold")
    for s in findings.strategies:
        ran = (
            ", ".join(f"{i}: {d or '(no device scope)'}" for i, d in enumerate(s.replica_devices))
            if s.replica_devices
            else "[yellow]never ran a step[/yellow]"
        )
        table.add_row(s.kind, _site(s.created_at, " <- "), str(s.replicas), ran)
    for run in findings.default_runs[:1]:
        devices = ", ".join(d or "TensorFlow's first device" for d in run.replica_devices)
        table.add_row(
            "[red]none (default)[/red]",
            "steps at " + _site(run.called_at, " <- "),
            "1",
            f"0: {devices}",
        )
    return table


def _variable_table(findings: ScriptFindings) -> Table:
    table = Table(title="Variables by creation site", title_justify="left")
    table.add_column("created at", overflow="fold")
    table.add_column("variables", justify="right")
    # Sites and device names are single long words: folded, never cut to "…" (the repair's
    # site is the line a user looks for).
    table.add_column("strategy scope", overflow="fold")
    table.add_column("devices", overflow="fold")
    multi = any(s.replicas > 1 for s in findings.strategies)
    for g in findings.variables:
        if g.strategy is None and g.repaired_by:
            scope = f"outside, then moved in: {g.repaired_by}"
        elif g.strategy is None:
            scope = "[red]outside any scope[/red]" if multi else "none"
        else:
            scope = f"{g.strategy} ({g.replicas} replicas)"
        table.add_row(
            _site(g.created_at, " <- "),
            f"{g.count} ({g.trainable} trainable)",
            scope,
            ", ".join(g.devices),
        )
    return table


def _never_ran_note(findings: ScriptFindings) -> str | None:
    idle = [s for s in findings.strategies if s.replicas > 1 and not s.replica_devices]
    if not idle or not findings.default_runs:
        return None
    return (
        f"{idle[0].kind} never ran a step: the training steps ran on the default strategy, "
        "1 device. Keras trains a model under the strategy whose scope it was built in."
    )


def render(findings: ScriptFindings, console: Console) -> None:
    """Prints the findings as tables, then the problems and the fix."""
    console.print(f"[bold]tfscale doctor --script {findings.script}[/bold]", soft_wrap=True)
    if findings.devices_set_by_doctor:
        console.print(
            f"The CPU was split into {findings.virtual_devices} logical devices for this run "
            "(TFSCALE_VIRTUAL_DEVICES was unset and TensorFlow sees no GPU), so a "
            f"MirroredStrategy() in the script gets {findings.virtual_devices} replicas."
        )
    if findings.strategies or findings.default_runs:
        console.print(_strategy_table(findings))
    if findings.variables:
        console.print(_variable_table(findings))
    elif not findings.crashed:
        console.print("The script created no variables in its main thread.")
    for problem in findings.problems:
        console.print(f"[red]Problem:[/red] {problem}", soft_wrap=True, highlight=False)
    note = _never_ran_note(findings)
    if note:
        console.print(note)
    if findings.problems:
        console.print(f"Fix: {_FIX}", soft_wrap=True, highlight=False)
    elif any(s.replicas > 1 for s in findings.strategies) and not findings.loop_problems:
        moved = sum(g.count for g in findings.variables if g.repaired_by)
        console.print(
            "[green]OK:[/green] every variable was created inside the strategy's scope"
            + (f" or moved into it before training ({moved} moved)." if moved else ".")
        )
    for problem in findings.loop_problems:
        console.print(f"[red]Problem:[/red] {problem}", soft_wrap=True, highlight=False)
    if findings.loop_problems:
        console.print(f"Fix: {_LOOP_FIX}", soft_wrap=True, highlight=False)
    for problem in findings.data_problems:
        console.print(f"[red]Problem:[/red] {problem}", soft_wrap=True, highlight=False)
    if findings.data_problems:
        console.print(f"Fix: {_DATA_FIX}", soft_wrap=True, highlight=False)
    if findings.timed_out:
        console.print(
            "[yellow]The script ran past the timeout and was stopped[/yellow]; "
            "the findings cover what it did until then."
        )
    elif findings.crashed:
        console.print(
            f"[red]The script failed with exit status {findings.exit_status}.[/red] "
            "The end of its stderr:"
        )
        console.print(findings.stderr_tail, markup=False, highlight=False, soft_wrap=True)


def _tail(path: str, lines: int = _STDERR_TAIL_LINES) -> str:
    with (
        contextlib.suppress(FileNotFoundError),
        open(path, encoding="utf-8", errors="replace") as f,
    ):
        return "".join(f.readlines()[-lines:]).rstrip()
    return ""


@contextlib.contextmanager
def _output_file(path: str, keep: bool) -> Iterator[TextIO | None]:
    """The child's stdout: inherited (None) when shown, else a file kept away from JSON."""
    if keep:
        yield None
        return
    with open(path, "w", encoding="utf-8") as handle:
        yield handle


def run_script(
    argv: Sequence[str], *, json_output: bool = False, timeout: float | None = None
) -> int:
    """Runs a training script under scope instrumentation and reports what it found.

    The script (``argv[0]``, with ``argv[1:]`` as its arguments) runs as ``__main__`` in a
    child Python process. Every variable it creates in its main thread is recorded with its
    creation site and the strategy scope active then; every strategy it constructs is
    recorded with the device each replica's step ran on. Without a GPU and without
    ``TFSCALE_VIRTUAL_DEVICES``, the child splits the CPU into 2 logical devices first.

    Args:
        argv: The script's path and its arguments.
        json_output: Print the findings as JSON (the script's stdout is then not shown)
            instead of tables.
        timeout: Seconds after which the script is stopped (with its process group) and
            the findings so far are reported; None waits for it to finish.

    Returns:
        The script's own exit status when it failed; otherwise 1 when variables were
        created outside the scope of a multi-replica strategy, else 0.

    Raises:
        TfscaleError: No script was given or the file does not exist.
    """
    script = check_script(argv[0] if argv else None, command="tfscale doctor --script")
    args = list(argv[1:])
    with tempfile.TemporaryDirectory(prefix="tfscale-doctor-") as folder:
        events_path = os.path.join(folder, "events.jsonl")
        stderr_path = os.path.join(folder, "stderr.txt")
        with (
            _output_file(os.path.join(folder, "stdout.txt"), keep=not json_output) as out,
            open(stderr_path, "w", encoding="utf-8") as err,
        ):
            ran = run_in_child(
                "tfscale.doctor.instrument",
                [events_path, script, *args],
                timeout=timeout,
                stdout=out,
                stderr=err,
            )
        findings = summarize(
            read_events(events_path),
            script=script,
            args=args,
            exit_status=ran.status,
            timed_out=ran.timed_out,
            stderr_tail=_tail(stderr_path),
        )
    if json_output:
        ok = not findings.problems and not findings.data_problems and not findings.loop_problems
        payload = {**asdict(findings), "crashed": findings.crashed, "ok": ok}
        print(json.dumps(payload, indent=2))
    else:
        render(findings, make_console())
    return exit_status(findings)
