"""Where a benchmark's JSON came from: the commit of the code that ran and the command line.

The device machines run a copy of the working tree whose git metadata may lag behind it, so the
caller can name the commit in $JTILERT_COMMIT (`bench/gpu_session.sh` records it in session.txt);
otherwise git is asked, with " dirty" appended for local changes."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys


def _git(*args) -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def commit() -> str:
    if os.environ.get("JTILERT_COMMIT"):
        return os.environ["JTILERT_COMMIT"]
    head = _git("rev-parse", "HEAD") or "unknown"
    return head + " dirty" if _git("status", "--porcelain", "--untracked-files=no") else head


# environment variables that change how the runtime runs a program (not what is traced): a command
# line records those that are set
RUNTIME_ENV = ("PJRT_GPU_ENABLE_ASYNC_DISPATCH",)


def command(module: str, argv) -> str:
    """The command line that ran `module` with `argv` (None: this process's own arguments), after the
    RUNTIME_ENV variables that are set."""
    args = sys.argv[1:] if argv is None else list(argv)
    env = [f"{k}={os.environ[k]}" for k in RUNTIME_ENV if k in os.environ]
    return " ".join(shlex.quote(x) for x in [*env, os.path.basename(sys.executable), "-m", module, *args])
