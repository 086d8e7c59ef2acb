"""TensorFlow's start-up chatter, kept off tfscale's commands unless asked for.

Importing TensorFlow 2.21 prints, from C++ static initializers and whatever
``TF_CPP_MIN_LOG_LEVEL`` says (it is read too late for them)::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:... port.cc:153] oneDNN custom operations are on. You may see ...
    I0000 00:00:... cpu_feature_guard.cc:227] This TensorFlow binary is optimized ...
    To enable the following instructions: AVX2 ...

twice, before a command has said anything. ``TF_ENABLE_ONEDNN_OPTS=0`` would silence one
line but change the numerics, so instead: while the ``tensorflow`` module is imported, the
process's standard error (file descriptor 2, where C++ writes) goes to a temporary file, and
every line of it that is not chatter is written back (:func:`install`); a child's output
relayed by the process layer drops the same lines (:func:`is_chatter`); the import itself is
caught by ``tfscale/tf_import.py``. ``tfscale --verbose``, or ``TF_CPP_MIN_LOG_LEVEL`` set by
the user, keeps everything.

TensorFlow-free: the launcher and the command line's parser use it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["ENV_VAR", "decide", "is_chatter", "quiet", "quiet_python_loggers", "quiet_stderr"]

# "1" in the environment: this process and its children keep TensorFlow's chatter off.
ENV_VAR = "TFSCALE_QUIET_TF"

# Searched anywhere in a line: a child's C++ and Python output share one pipe, and under load
# a line can start with what another writer left unfinished.
_PATTERNS = (
    r"WARNING: All log messages before absl::InitializeLog\(\) is called",
    r"[IW]\d{4} [\d:. ]+\s+\d+ (port|cpu_feature_guard)\.cc:\d+\]",
    r"oneDNN custom operations are on",
    r"^To enable the following instructions: ",
    r"WARNING:tensorflow:From .*: The name tf\.\S+ is deprecated",
)
_CHATTER = re.compile("|".join(f"(?:{p})" for p in _PATTERNS))


def is_chatter(line: str) -> bool:
    """Whether ``line`` is TensorFlow start-up chatter (see the module doc)."""
    return bool(_CHATTER.search(line))


def quiet() -> bool:
    """Whether this process keeps the chatter off (``TFSCALE_QUIET_TF=1``)."""
    return os.environ.get(ENV_VAR) == "1"


def decide(verbose: bool) -> bool:
    """The command line's decision, exported to this process and its children.

    Quiet unless ``verbose`` or the user set ``TF_CPP_MIN_LOG_LEVEL`` (then it is theirs to
    choose; a value tfscale itself set for a quiet parent, or an earlier quiet command in this
    process, does not count). When quiet, TensorFlow's own C++ logging is set to warnings and
    above.

    Returns:
        Whether the chatter is kept off.
    """
    ours = os.environ.get(ENV_VAR) == "1"
    keep = verbose or ("TF_CPP_MIN_LOG_LEVEL" in os.environ and not ours)
    os.environ[ENV_VAR] = "0" if keep else "1"
    if not keep:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return not keep


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Holds back file descriptor 2 while inside, then writes back its non-chatter lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().decode("utf-8", errors="replace").splitlines()
                if not is_chatter(line)
            ]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()


def quiet_python_loggers() -> None:
    """TensorFlow's Python logger to errors only (its deprecation and retracing notes)."""
    import logging

    logging.getLogger("tensorflow").setLevel(logging.ERROR)
