"""Test set-up: 8 host devices for mesh tests (before jax is imported), fp32 matmuls on CPU, quick XLA compiles;
the shared fixtures."""

import logging
import os
import warnings
import zlib
from types import SimpleNamespace

# LLVM at -O0: the tests' programs are small and compiled once, so compiling is most of their time
# (about 15 % less with -O0); floating-point semantics do not change with the optimisation level.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests patch traced code (op implementations, the engine's emit switch), which no program-cache key
# sees: only tests/test_compile_cache.py turns the program cache on.
os.environ["JTILERT_PROGRAM_CACHE"] = "off"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _seeded_numpy(request):
    """Every test starts with numpy's global generator seeded from its id (file, name, parameters): the
    kernel tests draw their inputs' keys from it (`interpreted.new_key`), so a case sees the same inputs
    in every run, whatever worker or order runs it."""
    np.random.seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def tiny_random():
    """A random fp32 model of the tiny architecture (session-wide: building it takes seconds)."""
    from jtilert import random_model
    return random_model("tiny", fmt="fp32")


@pytest.fixture(scope="session")
def tiny_fp8():
    """The tiny architecture with fp8 block-scaled weights."""
    from jtilert import random_model
    return random_model("tiny", fmt="fp8", seed=1)


def _mount_tmpfs(path, options: str) -> bool:
    import subprocess
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _umount(path) -> None:
    import subprocess
    subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nothing can be written into: mode 555, or for root (whom modes do not stop) a read-only
    tmpfs; skipped where neither works."""
    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o555)
    try:
        (d / "probe").touch()
    except OSError:
        yield d
        d.chmod(0o755)
        return
    (d / "probe").unlink()
    d.chmod(0o755)
    if not _mount_tmpfs(d, "ro,size=64k"):
        pytest.skip("no way to make a read-only folder here (root without mount)")
    yield d
    _umount(d)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (mounting needs root; skipped elsewhere)."""
    d = tmp_path / "small-disk"
    d.mkdir()
    if not _mount_tmpfs(d, "size=256k"):
        pytest.skip("cannot mount a tmpfs here")
    yield d
    _umount(d)


@pytest.fixture
def cli_here(capfd, caplog):
    """`python -m jtilert.cli ARGS` as `jtilert.cli.main(ARGS)`: (returncode, stdout, stderr). stderr
    holds what the file descriptors got and what a fresh process would print there besides: the
    warnings Python shows by default and the log records of level WARNING and up. An exception that
    escapes fails the test, as its traceback would."""
    from jtilert import cli as jcli

    def run(*args):
        caplog.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            code = jcli.main(list(args))
        out, err = capfd.readouterr()
        hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
        err += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught if not issubclass(w.category, hidden))
        err += "".join(f"{r.levelname}: {r.getMessage()}\n" for r in caplog.records if r.levelno >= logging.WARNING)
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return run
