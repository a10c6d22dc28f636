"""Shared paths and the CLI the Python API is compared with."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def castor_bin() -> Path:
    """The CLI built by `cargo test --workspace` (or CASTOR_BIN)."""
    path = Path(os.environ.get("CASTOR_BIN", ROOT / "target" / "debug" / "castor"))
    if not path.is_file():
        pytest.fail(f"no castor binary at {path}: run `cargo build` first or set CASTOR_BIN")
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    """Runs the castor CLI; fails the test when it fails."""
    done = subprocess.run([str(castor_bin()), *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, f"castor {' '.join(map(str, args))}: {done.stderr}"
    return done
