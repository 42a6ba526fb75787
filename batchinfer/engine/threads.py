"""How many threads the engine's CPU work runs on, and how its OpenMP threads wait (issue 21, contention).

torch's CPU wheel runs its intra-op parallelism on GNU OpenMP: `ldd torch/lib/libtorch_cpu.so` shows the
libgomp.so.1 bundled in torch/lib (MKL and oneDNN run on the same OpenMP threads). libgomp reads
OMP_NUM_THREADS, OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it initialises, i.e. when torch is
imported; so the entry points that start engines (the CLI, the workers, the benches) call
`configure_openmp_env()` before anything imports torch, and a value the user set is never overridden.

Why: a small model's step is hundreds of short parallel regions, each ending in a barrier. By default an
idle libgomp thread spins (up to GOMP_SPINCOUNT = 300k iterations) before it sleeps. With another busy
process on the machine one of our threads shares a core with it: the others spin at every barrier until
the descheduled one comes back, burning CPU time that produces nothing and stealing the core from the
thread they wait for (issue 21 measured ~25 tokens per CPU-second under contention vs ~170 for OpenVINO).
The defaults below (measured with bench/contention.py, figures in the README) make waiting threads yield
soon and, when other work is already runnable at start, use one thread fewer than the cores we may run on.

Measured on the 2-core bench machine (SmolLM2-135M, 24 chat prompts, fresh process per setting,
bench/contention.py; the machine is shared, so single runs are noisy):
- libgomp's defaults, contended: 18% (fp32) / 44% (bf16) of the quiet tokens per CPU-second;
- these defaults (short spin, one thread fewer when loaded at start), contended: 139% kept (bf16; one
  thread on the free core is more CPU-efficient than two), quiet as fast as libgomp's defaults;
- GOMP_SPINCOUNT=10000 with two threads when the load arrives after start: 42% kept (bf16; 91% in a
  noisier fp32 run), so the thread count chosen at start is what carries the target;
- GOMP_SPINCOUNT=0 (pure PASSIVE), two threads: 93% kept contended, but ~33% fewer quiet tok/s (a futex
  wake-up per parallel region): a user on a machine that gets busy later can set it.
The thread count is chosen once, when the process starts: libgomp reads these variables only then.
"""

from __future__ import annotations

import os
import time
from collections.abc import MutableMapping

# libgomp's wait policy: a waiting thread spins GOMP_SPINCOUNT iterations, then sleeps on a futex. A short
# spin keeps the quiet speed (the next region usually starts within microseconds) while a thread waiting
# for a descheduled peer goes to sleep instead of burning the core it shares.
OPENMP_WAIT_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
# Other runnable tasks (besides this process) at start from which the machine counts as loaded.
LOADED_AT_RUNNABLE = 1
_LOADAVG = "/proc/loadavg"


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's or taskset's), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def other_runnable_tasks(samples: int = 3, interval_s: float = 0.01) -> int:
    """Runnable tasks on the machine besides this one: the smallest of a few /proc/loadavg readings.

    The fourth field of /proc/loadavg is "running/total" now (not an average); the reading process is
    one of the running ones. The smallest of a few samples ignores a task that just happened to run.
    """
    readings = []
    for i in range(samples):
        try:
            with open(_LOADAVG) as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        readings.append(max(0, running - 1))
        if i + 1 < samples:
            time.sleep(interval_s)
    return min(readings)


def choose_num_threads(cores: int, other_runnable: int) -> int:
    """Threads for our CPU work: every core, or one fewer when other work is runnable and cores > 1.

    A thread that shares its core with a busy process holds every barrier of every parallel region;
    with one thread fewer the others run on cores of their own.
    """
    if cores > 1 and other_runnable >= LOADED_AT_RUNNABLE:
        return cores - 1
    return cores


def configure_openmp_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the OpenMP thread count and wait policy defaults (before torch is imported); what was set.

    Variables already in the environment are the user's choice and stay as they are.
    """
    env = os.environ if environ is None else environ
    chosen: dict[str, str] = dict(OPENMP_WAIT_DEFAULTS)
    if "OMP_NUM_THREADS" not in env:
        chosen["OMP_NUM_THREADS"] = str(choose_num_threads(usable_cores(), other_runnable_tasks()))
    applied = {}
    for name, value in chosen.items():
        if name not in env:
            env[name] = value
            applied[name] = value
    return applied
