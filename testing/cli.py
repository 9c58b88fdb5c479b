"""Runs the `pdserve` command line inside a test process."""

from __future__ import annotations

import pytest


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`pdserve ARGV` in this process: (exit code, stdout, stderr)."""
    from pdserve.deploy.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err
