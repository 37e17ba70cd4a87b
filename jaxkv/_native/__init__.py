"""Native XLA:CPU kernels: C++ sources compiled on first use, called through XLA FFI.

Two kernels, one library: ``paged_decode.cc``, paged attention for rows of
one query token read in place through the view's element strides, and
``kv_write.cc``, the KV write of a step's tokens into the pool in place (see
each source's header). It is built with the machine's C++ compiler the first time
it is asked for (about 4 s), against the headers jaxlib ships
(:func:`jax.ffi.include_dir`), with ``-march=native``, and cached under
``$JAXKV_CACHE_DIR`` (default ``~/.cache/jaxkv``) by a hash of the source,
the flags, the jaxlib version and the machine, so a process after the first
loads it in milliseconds. ``JAXKV_NATIVE=0`` turns it off; without a compiler
:func:`available` is False and the callers use XLA.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import jax

_log = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("paged_decode.cc", "kv_write.cc")
)
_TARGET = "jaxkv_paged_decode"
_WRITE_TARGET = "jaxkv_kv_write"
_FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=fast",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-w",
)


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
    key = hashlib.sha256(
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
    out_dir = _cache_dir()
    lib = out_dir / f"kernels-{key}.so"
    if lib.exists():
        return lib
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
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@cache
def _register() -> str | None:
    """Builds, loads and registers the kernel once; the reason it could not, or None."""
    if os.environ.get("JAXKV_NATIVE", "1") == "0":
        return "turned off by JAXKV_NATIVE=0"
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
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


def by_default() -> bool:
    """Whether jaxkv takes the native kernels unasked in this process: XLA:CPU,
    one device (XLA's SPMD partitioner cannot split a custom call, so a
    sharded operand would be gathered whole), the library built.

    Example:
      >>> from jaxkv import _native
      >>> isinstance(_native.by_default(), bool)
      True
    """  # noqa: D205
    return jax.default_backend() == "cpu" and jax.device_count() == 1 and available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True)."""
    return _register()


def target(name: str = "paged_decode") -> str:
    """The FFI target of a kernel, ``"paged_decode"`` or ``"kv_write"``
    (registered on first use).
    """  # noqa: D205
    reason = _register()
    if reason is not None:
        raise RuntimeError(f"jaxkv's native CPU kernel is not available: {reason}")
    return {"paged_decode": _TARGET, "kv_write": _WRITE_TARGET}[name]
