"""Builds the CUDA engine (``cuda/``) with CMake into a cache directory.

    python -m jtilert.ffi.build [--selftest] [--build-dir DIR] [--verbose]

prints the path of ``libjtilert_engine.so``. The default build directory is
``$JTILERT_FFI_CACHE`` or ``~/.cache/jtilert/ffi/<hash of the sources, their
folder and the jax version>``, so a changed or moved source tree gets a fresh
build and an unchanged one is reused. ``JTILERT_FFI_LIB`` names a prebuilt library instead.

Many processes may share one build directory (a test suite, workers of a
bench): a build holds an exclusive lock on ``<dir>.lock`` and, once the
library is linked, writes ``<library>.built``; `find_library` takes the lock
shared and trusts only a library with that mark, so no process loads one that
is still being linked or whose link was killed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys

LIB_NAME = "libjtilert_engine.so"
BUILT = LIB_NAME + ".built"  # written after a complete build, removed before one starts


def source_dir() -> pathlib.Path | None:
    """The ``cuda/`` directory of this checkout, if the package runs from one."""
    d = pathlib.Path(__file__).resolve().parents[2] / "cuda"
    return d if (d / "CMakeLists.txt").is_file() else None


def _source_hash(src: pathlib.Path) -> str:
    import jax  # noqa: PLC0415

    # The folder is part of the key: CMake ties a build directory to one source
    # directory, so an identical copy of cuda/ elsewhere gets a build of its own.
    h = hashlib.sha256(jax.__version__.encode())
    h.update(str(src.resolve()).encode())
    for p in sorted(src.rglob("*")):
        if p.is_file() and p.suffix in {".cu", ".cuh", ".cc", ".h", ".txt"}:
            h.update(str(p.relative_to(src)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def default_build_dir(src: pathlib.Path | None = None) -> pathlib.Path | None:
    src = src or source_dir()
    if src is None:
        return None
    root = os.environ.get("JTILERT_FFI_CACHE")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "jtilert" / "ffi"
    return base / _source_hash(src)


def find_library() -> pathlib.Path | None:
    """A usable library path without building: $JTILERT_FFI_LIB or the cache."""
    env = os.environ.get("JTILERT_FFI_LIB")
    if env:
        p = pathlib.Path(env)
        return p if p.is_file() else None
    d = default_build_dir()
    if d is None or not d.is_dir():
        return None

    def built():
        return d / LIB_NAME if (d / BUILT).is_file() and (d / LIB_NAME).is_file() else None

    try:
        with _lock(_lock_path(d), fcntl.LOCK_SH):  # waits for a build in progress
            return built()
    except PermissionError:   # a cache this user may read but not lock: no build of its own runs there
        return built()


def toolchain_missing() -> str | None:
    """Why a build cannot run here, or None."""
    if source_dir() is None:
        return "the cuda/ sources are not next to this package"
    for tool in ("cmake", "nvcc"):
        if shutil.which(tool) is None and not (tool == "nvcc" and os.path.exists("/usr/local/cuda/bin/nvcc")):
            return f"{tool} not found"
    return None


def _lock_path(bdir: pathlib.Path) -> pathlib.Path:
    return bdir.parent / (bdir.name + ".lock")


@contextlib.contextmanager
def _lock(path: pathlib.Path, kind: int = fcntl.LOCK_EX):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, kind)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(build_dir: str | os.PathLike | None = None, *, selftest: bool = False,
          verbose: bool = False, jobs: int | None = None) -> pathlib.Path:
    """Configures and builds the library; returns its path. Raises on failure."""
    import jax.ffi  # noqa: PLC0415

    src = source_dir()
    if src is None:
        raise RuntimeError("jtilert.ffi.build: cuda/ sources not found")
    bdir = pathlib.Path(build_dir) if build_dir else default_build_dir(src)
    assert bdir is not None
    env = dict(os.environ)
    if shutil.which("nvcc") is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        env["PATH"] = "/usr/local/cuda/bin:" + env.get("PATH", "")
    cfg = ["cmake", "-S", str(src), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release",
           f"-DJTILERT_XLA_FFI_INCLUDE={jax.ffi.include_dir()}",
           f"-DJTILERT_SELFTEST={'ON' if selftest else 'OFF'}"]
    if shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    jobs = jobs or os.cpu_count() or 2
    out = None if verbose else subprocess.PIPE
    lib = bdir / LIB_NAME
    with _lock(_lock_path(bdir)):
        (bdir / BUILT).unlink(missing_ok=True)
        if (bdir / "CMakeCache.txt").exists():
            # a cache from another generator cannot be reused
            gen = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
            if f"CMAKE_GENERATOR:INTERNAL={gen}" not in (bdir / "CMakeCache.txt").read_text():
                shutil.rmtree(bdir)
        for cmd in (cfg, ["cmake", "--build", str(bdir), "-j", str(jobs)]):
            r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
            if r.returncode != 0:
                tail = (r.stdout or "")[-4000:]
                raise RuntimeError(f"jtilert.ffi.build: {' '.join(cmd)} failed:\n{tail}")
        if not lib.is_file():
            raise RuntimeError(f"jtilert.ffi.build: {lib} missing after the build")
        (bdir / BUILT).touch()
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=None)
    ap.add_argument("--selftest", action="store_true", help="also build jtilert_selftest")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    a = ap.parse_args(argv)
    why = toolchain_missing()
    if why:
        print(f"cannot build: {why}", file=sys.stderr)
        return 1
    print(build(a.build_dir, selftest=a.selftest, verbose=a.verbose, jobs=a.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
