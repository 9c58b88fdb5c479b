"""The nodes' fault hook (`node_common.faults`): absent from the environment a node runs its kind's no-op
hook; a test's hook travels to a node process as its class's name and JSON fields and is rebuilt there
as it was, by either node kind; its step faults follow their trigger files; a hook of the wrong kind, or
a malformed variable, stops the node at start."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pdserve.kernels import get_kernel_ops
from pdserve.kv_transfer import KVSender
from pdserve.node_common.faults import FAULTS_ENV, FAULTS_SPEC_ENV, NodeFaults, load_faults
from pdserve.prefill_node.faults import PrefillFaults
from testing.faults import Faults, FaultySender


@pytest.mark.parametrize("hook_class", [NodeFaults, PrefillFaults])
def test_without_the_variable_a_node_runs_the_no_op_hook(monkeypatch: pytest.MonkeyPatch,
                                                         hook_class: type[NodeFaults]) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    hook = load_faults(hook_class)
    assert type(hook) is hook_class
    hook.before_step()
    if isinstance(hook, PrefillFaults):
        assert type(hook.new_sender(get_kernel_ops("torch"))) is KVSender


@pytest.mark.parametrize("hook_class", [NodeFaults, PrefillFaults])
def test_a_hook_is_rebuilt_from_its_environment(monkeypatch: pytest.MonkeyPatch,
                                                hook_class: type[NodeFaults]) -> None:
    faults = Faults(step_trigger="/nonexistent/fault", send_stall_s=4.0, send_corrupt=True)
    for name, value in faults.env().items():
        monkeypatch.setenv(name, value)
    hook = load_faults(hook_class)
    assert isinstance(hook, Faults) and hook == faults
    assert isinstance(hook.new_sender(get_kernel_ops("torch")), FaultySender)
    assert Faults(send_delay_s=1.0).node_args() == ["--no-layerwise-send"] and faults.node_args() == []


def test_step_faults_follow_their_trigger_files(tmp_path: Path) -> None:
    faults = Faults(step_trigger=str(tmp_path / "fault"))
    assert (faults.step_fail_file, faults.step_hang_file) == (tmp_path / "fault.fail", tmp_path / "fault.hang")
    faults.before_step()  # no trigger file: the step goes on
    faults.step_fail_file.touch()
    with pytest.raises(RuntimeError, match="injected step failure"):
        faults.before_step()
    faults.step_fail_file.unlink()
    faults.step_hang_file.touch()
    step = threading.Thread(target=faults.before_step, daemon=True)
    step.start()
    step.join(timeout=0.3)
    assert step.is_alive(), "a step runs on while the hang file exists"
    faults.step_hang_file.unlink()
    step.join(timeout=10)
    assert not step.is_alive(), "the step goes on once the hang file is gone"


class _OtherKind:
    """A hook of some other node kind."""


@pytest.mark.parametrize(("target", "spec", "error"), [
    (f"{__name__}:_OtherKind", "{}", TypeError),
    ("pdserve.node_common.faults:NodeFaults", "{}", TypeError),  # lacks the prefill node's points
    ("testing.faults", "{}", ValueError),
    ("testing.faults:Faults", "[1]", ValueError),
    ("testing.faults:Faults", '{"send_stall_s": -1}', ValueError),
])
def test_a_bad_hook_stops_the_node_at_start(monkeypatch: pytest.MonkeyPatch, target: str, spec: str,
                                            error: type[Exception]) -> None:
    monkeypatch.setenv(FAULTS_ENV, target)
    monkeypatch.setenv(FAULTS_SPEC_ENV, spec)
    with pytest.raises(error):
        load_faults(PrefillFaults)

