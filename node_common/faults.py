"""Test-only fault injection behind one hook object per node process; production runs the no-op hook.

A node kind's serving code holds a hook, an instance of that kind's hook class (`prefill_node.faults.
PrefillFaults`), and calls it at a few named points; the hook class itself changes nothing. A test harness
that starts a node process picks another implementation for it through two environment variables, read
once as the node starts (`load_faults`):

    PDSERVE_TEST_FAULTS=module:factory         imported from the node's sys.path (the implementations
                                               live in the checkout's `testing/`, which is never installed)
    PDSERVE_TEST_FAULTS_SPEC={"stall_s": 4.0}  a JSON object: the factory's keyword arguments (default {})

Without PDSERVE_TEST_FAULTS the node builds its hook class and imports nothing. A factory must return an
instance of that class, so a hook meant for another node kind is refused at start rather than ignored.
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

H = TypeVar("H")


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
