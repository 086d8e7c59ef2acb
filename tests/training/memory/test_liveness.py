"""The liveness walk of a traced graph's ops, on op records given by hand."""

from __future__ import annotations

import pytest

from tfscale.training.memory.liveness import OpRecord, peak_bytes


def _op(kind: str, inputs: tuple[str, ...], *outputs: tuple[str, int]) -> OpRecord:
    return OpRecord(kind, inputs, outputs)


def test_liveness_frees_after_last_use_and_shares_aliased_buffers() -> None:
    ops = [
        _op("Placeholder", (), ("x", 100)),
        _op("MatMul", ("x",), ("a", 10)),
        _op("Reshape", ("a",), ("a2", 10)),  # a view of a: no new buffer
        _op("Relu", ("a2",), ("b", 20)),
        _op("Unused", ("b",), ("dead", 1000)),  # read by nothing: freed at once
        _op("MatMul", ("b",), ("c", 30)),  # b's last use; a's last use was Relu
        _op("ReadVariableOp", (), ("w", 500)),  # the variable's buffer: not the step's
        _op("Mul", ("c", "w"), ("g", 5)),
    ]
    peak, end = peak_bytes(ops, kept=["g"])
    # At "Unused": b (20) + dead (1000); a was freed after Relu.
    assert peak == 20 + 1000
    assert end == 5


@pytest.mark.parametrize("kept", [["c"], []])
def test_liveness_keeps_what_the_caller_keeps(kept: list[str]) -> None:
    ops = [_op("Const", (), ("k", 4)), _op("Exp", ("k",), ("c", 30)), _op("Neg", ("c",), ("d", 7))]
    peak, end = peak_bytes(ops, kept=kept)
    assert peak == 37
    assert end == (30 if kept else 0)
