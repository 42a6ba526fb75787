"""Building batchinfer's native CPU kernels once per installation, and finding that build again.

The sources: the `.cpp` / `.h` files of `csrc/` beside this module (package data), compiled with
torch.utils.cpp_extension (g++, ninja) into one extension (`SOURCES`; bindings.cpp names its functions).

The key: everything that decides the binary goes into the extension's name, so one name is one binary:
the C++ sources (every file of csrc/, names and text), torch's version and C++ ABI, Python's extension
ABI (EXT_SUFFIX), the compiler (CXX) and flags, the machine and its CPU flags (the flags include
-march=native). A different torch, Python or CPU gets its own build beside the others instead of
overwriting theirs.

Where (`kernel_dirs`): $BATCHINFER_KERNEL_DIR when set, else `<sys.prefix>/share/batchinfer/kernels`
(the venv, or the Docker image's /opt/venv: one cache per installation, filled by `batchinfer
build-kernels` at install), else, where that is not writable, `<BATCHINFER_DATA_DIR>/kernels` (the data
volume in a container). Paths are resolved (realpath), so one venv reached through a symlink is one cache.

A finished build is marked complete and later processes import its .so directly, without asking torch's
JIT (whose ninja file records include paths: the same venv under another path would rebuild). A build
is announced on stderr with its progress (`BuildProgress`), and guarded by `build_lock` (a builder killed
mid-build never leaves later processes waiting).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

KERNEL_DIR_ENV = "BATCHINFER_KERNEL_DIR"  # an explicit cache directory (tests, shared read-only images)
BUILD_WAIT_S = 900.0  # longest wait for another process's build (a build takes about a minute on 2 cores)
BUILD_WAIT_LOG_S = 30.0  # while waiting, say so this often
PROGRESS_EVERY_S = 10.0  # while building, print how long it has taken this often
EXPECTED_BUILD_S = 40  # what the announcement promises (2 cores; the measured figure is in the README)
OWNER_LOCK_NAME = "batchinfer-build.lock"  # our lock beside torch's "lock" file, in the build directory
TORCH_LOCK_NAME = "lock"  # torch.utils.file_baton's lock: a plain file that a killed builder leaves behind
COMPLETE_NAME = "batchinfer-complete"  # written after a successful build; holds the key it was built for
CSRC_DIR = Path(__file__).resolve().with_name("csrc")  # the C++ sources, shipped as package data
SOURCES = ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp", "gguf_linear.cpp",  # the units compiled
           "decoder_stack.cpp", "panel_gemm.cpp", "amx_gemm.cpp", "amx_block_gemm.cpp",
           "greedy_head.cpp")


@dataclass(frozen=True)
class NativeBuild:
    """A loaded extension: its module, where it lives, and whether this process compiled it."""

    module: ModuleType
    directory: Path
    built: bool  # True: compiled by this process; False: found complete in the cache
    seconds: float  # how long loading (and building) took


def cache_key(source: str, cflags: list[str], ldflags: list[str]) -> str:
    """12 hex digits of everything that decides the binary (see the module docstring)."""
    import torch

    from batchinfer.engine.native.cpu_features import cpu_flags

    parts = [
        source, torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.implementation.cache_tag,
        str(sysconfig.get_config_var("EXT_SUFFIX")), os.environ.get("CXX", "c++"), " ".join(cflags),
        " ".join(ldflags), platform.machine(), " ".join(sorted(cpu_flags())),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def source_text(directory: Path = CSRC_DIR) -> str:
    """Every C++ file of `directory` (sources and headers), named, in one string: what cache_key hashes."""
    files = sorted(p for p in directory.iterdir() if p.suffix in (".cpp", ".h"))
    return "\0".join(f"{p.name}\0{p.read_text()}" for p in files)


def kernel_dirs() -> list[Path]:
    """Where builds are looked for, in order; the first writable one is where a new build goes."""
    explicit = os.environ.get(KERNEL_DIR_ENV)
    if explicit:
        return [Path(explicit).expanduser().resolve()]
    import platformdirs

    data_dir = os.environ.get("BATCHINFER_DATA_DIR") or platformdirs.user_data_dir("batchinfer",
                                                                                   appauthor=False)
    return [(Path(sys.prefix) / "share" / "batchinfer" / "kernels").resolve(),
            (Path(data_dir).expanduser() / "kernels").resolve()]


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def _library(directory: Path, name: str) -> Path:
    return directory / f"{name}.so"


def find_complete(name: str) -> Path | None:
    """The directory of a complete build of `name` in the cache, or None."""
    for root in kernel_dirs():
        directory = root / name
        marker = directory / COMPLETE_NAME
        if marker.is_file() and _library(directory, name).is_file():
            return directory
    return None


def _import(directory: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _library(directory, name))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {_library(directory, name)}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_or_build(*, name: str, cflags: list[str], ldflags: list[str], sources: tuple[str, ...] = SOURCES,
                  csrc: Path = CSRC_DIR, wait_s: float = BUILD_WAIT_S) -> NativeBuild | None:
    """The extension `name` (which must carry cache_key), imported from the cache or built there first.

    `sources` are file names under `csrc`, compiled with `csrc` on the include path.

    None when another live process held the build longer than `wait_s`, or no cache directory is
    writable. Compiler errors propagate (the caller falls back to its torch path).
    """
    start = time.monotonic()
    found = find_complete(name)
    if found is not None:
        return NativeBuild(_import(found, name), found, False, time.monotonic() - start)
    root = next((root for root in kernel_dirs() if _writable(root)), None)
    if root is None:
        logger.warning("native CPU kernels: no writable cache directory among %s; set %s",
                       ", ".join(map(str, kernel_dirs())), KERNEL_DIR_ENV)
        return None
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory, wait_s=wait_s) as held:
        if not held:
            return None
        if (directory / COMPLETE_NAME).is_file():  # another process built it while this one waited
            return NativeBuild(_import(directory, name), directory, False, time.monotonic() - start)
        from torch.utils.cpp_extension import load

        with BuildProgress(directory):
            module = load(name=name, sources=[str(csrc / source) for source in sources],
                          extra_cflags=cflags, extra_ldflags=ldflags, extra_include_paths=[str(csrc)],
                          build_directory=str(directory))
        (directory / COMPLETE_NAME).write_text(f"{name}\n")
    return NativeBuild(module, directory, True, time.monotonic() - start)


class BuildProgress:
    """Say on stderr that a build runs, how long it has taken every PROGRESS_EVERY_S, and when it ends."""

    def __init__(self, directory: Path, *, every_s: float = PROGRESS_EVERY_S) -> None:
        self.directory, self.every_s = directory, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="batchinfer-build-progress", daemon=True)

    def _say(self, text: str) -> None:
        print(f"batchinfer: {text}", file=sys.stderr, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            self._say(f"... still building native CPU kernels ({time.monotonic() - self._start:.0f} s)")

    def __enter__(self) -> BuildProgress:
        self._start = time.monotonic()
        self._say(f"building native CPU kernels (one time, ~{EXPECTED_BUILD_S} s) in {self.directory} ...")
        self._thread.start()
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        took = time.monotonic() - self._start
        self._say(f"native CPU kernels built in {took:.0f} s" if kind is None else
                  f"native CPU kernels: build failed after {took:.0f} s")


@contextmanager
def build_lock(directory: Path, *, wait_s: float = BUILD_WAIT_S) -> Iterator[bool]:
    """Hold the build directory for this process; yields False if another live process held it `wait_s`.

    torch's own lock is a plain file: a builder killed mid-build (kill -9, OOM) leaves it behind, and
    every later load waits on it forever, silently. Our lock is an flock(2) on a file beside it, which
    the kernel drops when its process dies, so whoever holds ours owns torch's: a torch lock file found
    while holding ours was left by a dead process and is removed (with a warning) before building.
    """
    path = directory / OWNER_LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_log = start + BUILD_WAIT_LOG_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - start >= wait_s:
                    logger.warning("native CPU kernels: process %s has been building %s for over %.0fs; not "
                                   "waiting longer, using the torch path (SDPA attention)", _holder(path),
                                   directory, wait_s)
                    yield False
                    return
                if now >= next_log:
                    logger.info("native CPU kernels: waiting for process %s, which is building them in %s "
                                "(%.0fs so far)", _holder(path), directory, now - start)
                    next_log = now + BUILD_WAIT_LOG_S
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        stale = directory / TORCH_LOCK_NAME
        if stale.exists():
            logger.warning("native CPU kernels: removing the stale build lock %s (the process that held it "
                           "is gone, killed while building?); rebuilding", stale)
            stale.unlink(missing_ok=True)
        yield True
    finally:
        os.close(fd)  # also releases the flock


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"
