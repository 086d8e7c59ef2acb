"""Whether a launched worker trained with the others: the pure judgement and the verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tfscale.launch.together import (
    Verdict,
    alone_reason,
    final_line,
    read_verdicts,
    write_verdict,
)


@pytest.mark.parametrize(
    ("strategy", "spans", "job", "ps", "alone"),
    [
        ("MultiWorkerMirroredStrategy", 2, 2, False, False),
        ("CollectiveAllReduceStrategy", 4, 4, False, False),
        ("MirroredStrategy", 1, 2, False, True),
        ("OneDeviceStrategy", 1, 2, False, True),
        ("MultiWorkerMirroredStrategy", 1, 2, False, True),  # a cluster of one
        ("MirroredStrategy", 1, 1, False, False),  # a one-worker job trains alone by design
        ("ParameterServerStrategyV2", 2, 2, True, False),
        ("MultiWorkerMirroredStrategy", 2, 2, True, True),  # a job with parameter servers
    ],
)
def test_alone_reason(strategy: str, spans: int, job: int, ps: bool, alone: bool) -> None:
    reason = alone_reason(strategy, spans, job, ps)
    assert (reason is not None) == alone
    if reason is not None:
        assert strategy in reason


def test_verdicts_round_trip_and_the_last_line_names_the_first_task(tmp_path: Path) -> None:
    write_verdict(str(tmp_path), Verdict("worker 1", "it built MirroredStrategy", "fix A"))
    write_verdict(str(tmp_path), Verdict("worker 0", "it built MirroredStrategy", "fix A"))
    verdicts = read_verdicts(str(tmp_path))
    assert [v.task for v in verdicts] == ["worker 0", "worker 1"]
    assert final_line(verdicts) == (
        "worker 0 did not train with the others (and 1 other task(s)): it built "
        "MirroredStrategy. Fix: fix A"
    )
