"""Native XLA:CPU kernels: C++ sources compiled on first use, called through XLA FFI.

Two kernels, one library: ``paged_decode.cc``, paged attention for rows of
one query token read in place through the view's element strides, and
``kv_write.cc``, the KV write of a step's tokens into the pool in place (see
each source's header). They run only when asked for
(``paged_attention(implementation="native")``, ``write_kv(...,
implementation="native")``). The library is built with the machine's C++
compiler the first time it is asked for (about 4 s), against the headers
jaxlib ships (:func:`jax.ffi.include_dir`), with ``-march=native`` and no
fast-math flag that changes a result (no reassociation, no FMA contraction,
signed zeros kept; what remains against XLA's path is the summation order
and the kernel's own ``exp``: about 1e-6 relative in float32), and cached
under ``$JAXKV_CACHE_DIR`` (default ``~/.cache/jaxkv``) by a hash of the
source, the flags, the jaxlib version and the machine, so a process after
the first loads it in milliseconds.

A cached library is loaded only after its size and SHA-256 match the record
written beside it when it was built: a truncated, foreign or unrecorded file
is removed and rebuilt (with a warning), and a library that lacks the
kernels' symbols is refused, never loaded into the callers' path. Without a
compiler, :func:`available` is False and asking for the kernels raises,
naming why.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import jax

_log = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("paged_decode.cc", "kv_write.cc")
)
_TARGET = "jaxkv_paged_decode"
_WRITE_TARGET = "jaxkv_kv_write"
# No flag that changes a result: -fno-math-errno only drops errno updates,
# -fno-trapping-math assumes no FP trap handler; FMA contraction is off.
_FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-w",
)
_SYMBOLS = ("JaxkvPagedDecode", "JaxkvKvWrite")


def _cache_dir() -> Path:
    own = os.environ.get("JAXKV_CACHE_DIR")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return Path(base) / "jaxkv"


def _cpu_flags() -> str:
    """What ``-march=native`` depends on: this CPU's feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    own = os.environ.get("CXX")
    if own and shutil.which(own):
        return own
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return name
    return None


def _library_key(cxx: str) -> str:
    """What a cached library was built from: sources, flags, jax, CPU, compiler.

    The CPU's instruction-set flags are part of it: a library built with
    ``-march=native`` on another CPU may execute an instruction this one
    lacks (SIGILL), so it is never reused here.
    """
    return hashlib.sha256(
        b"\0".join(
            [
                *(src.read_bytes() for src in _SOURCES),
                " ".join(_FLAGS).encode(),
                jax.__version_info__.__repr__().encode(),
                importlib.metadata.version("jaxlib").encode(),
                platform.machine().encode(),
                _cpu_flags().encode(),
                cxx.encode(),
            ]
        )
    ).hexdigest()[:16]


def build() -> Path:
    """Compiles the kernel library (or finds it cached) and returns its path.

    Raises:
      RuntimeError: No C++ compiler, or the compile failed (its output named).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(
            "jaxkv's native CPU kernel needs a C++ compiler (g++, c++ or "
            "clang++ on PATH, or $CXX); none was found."
        )
    key = _library_key(cxx)
    out_dir = _cache_dir()
    lib = out_dir / f"kernels-{key}.so"
    if lib.exists():
        problem = _check_entry(lib)
        if problem is None:
            return lib
        warnings.warn(
            f"jaxkv: the cached native kernel library {lib} {problem}; rebuilding it.",
            RuntimeWarning,
            stacklevel=3,
        )
        for path in (lib, _record_of(lib)):
            with contextlib.suppress(OSError):
                path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: processes that build at once
    # (a test run's subprocesses) never load a half-written library.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(
                f"compiling jaxkv's native CPU kernel failed ({' '.join(cmd)}):\n"
                f"{done.stderr[-2000:]}"
            )
        record = _record(Path(tmp))
        fd, tmp_record = tempfile.mkstemp(dir=out_dir, suffix=".sha256.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(record)
        # The record first, then the library: a reader in between finds no
        # library and builds its own (processes building at once, test
        # workers among them, never see a library without its record).
        os.replace(tmp_record, _record_of(lib))
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _record_of(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _record(lib: Path) -> str:
    """``"<size> <sha256>"`` of a library file."""
    data = lib.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _check_entry(lib: Path) -> str | None:
    """What is wrong with a cached library (``None``: it matches its record)."""
    try:
        want = _record_of(lib).read_text()
    except OSError:
        return "has no size and hash record"
    try:
        got = _record(lib)
    except OSError as err:
        return f"cannot be read ({err})"
    if got != want:
        return (
            f"does not match its record (size and SHA-256 {got.split()} != "
            f"{want.split()})"
        )
    return None


@cache
def _register() -> str | None:
    """Builds, loads and registers the kernel once; the reason it could not, or None."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
        if missing:
            raise RuntimeError(
                f"the library {lib._name} lacks the kernels' symbols {missing}"
            )
        jax.ffi.register_ffi_target(
            _TARGET, jax.ffi.pycapsule(lib.JaxkvPagedDecode), platform="cpu"
        )
        jax.ffi.register_ffi_target(
            _WRITE_TARGET, jax.ffi.pycapsule(lib.JaxkvKvWrite), platform="cpu"
        )
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        _log.info("jaxkv: native CPU kernel not available: %s", err)
        return str(err)
    return None


def available() -> bool:
    """Whether the native CPU kernel is built and registered (builds it if not).

    Example:
      >>> from jaxkv import _native
      >>> isinstance(_native.available(), bool)
      True
    """
    return _register() is None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True)."""
    return _register()


def target(name: str = "paged_decode") -> str:
    """The FFI target of a kernel (registered on first use).

    The FFI target of a kernel, ``"paged_decode"`` or ``"kv_write"``
    (registered on first use).
    """
    reason = _register()
    if reason is not None:
        raise RuntimeError(f"jaxkv's native CPU kernel is not available: {reason}")
    return {"paged_decode": _TARGET, "kv_write": _WRITE_TARGET}[name]
