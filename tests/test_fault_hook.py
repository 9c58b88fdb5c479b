"""The nodes' fault hook (`node_common.faults`): absent from the environment a node runs its kind's no-op
hook; a test's hook travels to a node process as its class's name and JSON fields and is rebuilt there
as it was; a hook of the wrong kind, or a malformed variable, stops the node at start."""

from __future__ import annotations

import pytest

from pdserve.kernels import get_kernel_ops
from pdserve.kv_transfer import KVSender
from pdserve.node_common.faults import FAULTS_ENV, FAULTS_SPEC_ENV, load_faults
from pdserve.prefill_node.faults import PrefillFaults
from testing.faults import FaultySender, SendFaults


def test_without_the_variable_a_node_runs_the_no_op_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    hook = load_faults(PrefillFaults)
    assert type(hook) is PrefillFaults
    assert type(hook.new_sender(get_kernel_ops("torch"))) is KVSender


def test_a_hook_is_rebuilt_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    faults = SendFaults(stall_s=4.0, corrupt=True)
    for name, value in faults.env().items():
        monkeypatch.setenv(name, value)
    hook = load_faults(PrefillFaults)
    assert hook == faults and isinstance(hook.new_sender(get_kernel_ops("torch")), FaultySender)
    assert SendFaults(delay_s=1.0).node_args() == ["--no-layerwise-send"] and faults.node_args() == []


class _OtherKind:
    """A hook of some other node kind."""


@pytest.mark.parametrize(("target", "spec", "error"), [
    (f"{__name__}:_OtherKind", "{}", TypeError),
    ("testing.faults", "{}", ValueError),
    ("testing.faults:SendFaults", "[1]", ValueError),
    ("testing.faults:SendFaults", '{"stall_s": -1}', ValueError),
])
def test_a_bad_hook_stops_the_node_at_start(monkeypatch: pytest.MonkeyPatch, target: str, spec: str,
                                            error: type[Exception]) -> None:
    monkeypatch.setenv(FAULTS_ENV, target)
    monkeypatch.setenv(FAULTS_SPEC_ENV, spec)
    with pytest.raises(error):
        load_faults(PrefillFaults)
