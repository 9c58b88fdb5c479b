"""Test-only fault injection behind one hook object per node process; production runs the no-op hook.

A node process loads its hook once, as it starts (`load_faults`): an instance of its kind's hook class,
`NodeFaults` (the points every node has; a decode node's hook class) or `prefill_node.faults.PrefillFaults`
(which extends it). Its serving code calls the hook at those few named points; the hook classes themselves
change nothing. A test harness that starts a node process picks another implementation for it through two
environment variables:

    PDSERVE_TEST_FAULTS=module:factory   imported from the node's sys.path (the implementations live in
                                         the checkout's `testing/`, which is never installed)
    PDSERVE_TEST_FAULTS_SPEC=JSON        an object: the factory's keyword arguments (default {}),
                                         e.g. {"send_stall_s": 4.0}

Without PDSERVE_TEST_FAULTS the node builds its hook class and imports nothing. A factory must return an
instance of that class, so a hook that lacks some of the node's points is refused at start rather than
ignored (a prefill node's hook has every point a decode node has: one hook may arm a whole cluster).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from typing import TypeVar

log = logging.getLogger(__name__)

FAULTS_ENV = "PDSERVE_TEST_FAULTS"
FAULTS_SPEC_ENV = "PDSERVE_TEST_FAULTS_SPEC"

H = TypeVar("H", bound="NodeFaults")


class NodeFaults:
    """Where any node lets a test change what it does; this base class changes nothing."""

    def before_step(self) -> None:
        """Called on the engine thread before every engine step (the engine steps only while it has
        requests). May raise, which fails the step as any error in it would, or block, which makes the
        step hang that long; changes nothing."""


def load_faults(hook_class: type[H]) -> H:
    """The node's fault hook: `hook_class()`, or what the factory named in the environment builds."""
    target = os.environ.get(FAULTS_ENV, "")
    if not target:
        return hook_class()
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{FAULTS_ENV} must look like module:factory, got {target!r}")
    spec = json.loads(os.environ.get(FAULTS_SPEC_ENV) or "{}")
    if not isinstance(spec, dict):
        raise ValueError(f"{FAULTS_SPEC_ENV} must be a JSON object, got {spec!r}")
    hook = getattr(importlib.import_module(module), name)(**spec)
    if not isinstance(hook, hook_class):
        raise TypeError(f"{FAULTS_ENV}={target} built a {type(hook).__name__}, not a {hook_class.__name__}")
    log.warning("test fault injection is on: %s(%s)", target, spec)
    return hook
