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
  wake-up per parallel region).

libgomp reads the variables once, but the thread count of later parallel regions follows
omp_set_num_threads (torch.set_num_threads) at any time. So while the engine runs, a ThreadGovernor
re-chooses it from what the CPUs we may run on did over the last second (/proc/stat minus our own CPU
time): one thread fewer for each core other work keeps busy, and back up when it leaves. It never goes
above a count the user set (OMP_NUM_THREADS, torch.set_num_threads), and stays off where OpenMP threads
are bound to places (OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY: the affinity it would read is then the
bound thread's, not the process's).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, MutableMapping

# libgomp's wait policy: a waiting thread spins GOMP_SPINCOUNT iterations, then sleeps on a futex. A short
# spin keeps the quiet speed (the next region usually starts within microseconds) while a thread waiting
# for a descheduled peer goes to sleep instead of burning the core it shares.
OPENMP_WAIT_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
# Other runnable tasks (besides this process) at start from which the machine counts as loaded.
LOADED_AT_RUNNABLE = 1
_LOADAVG = "/proc/loadavg"
_PROC_STAT = "/proc/stat"
# Names of the variables configure_openmp_env set itself, so that a child process (a worker it spawns)
# can tell batchinfer's choice from the user's.
CHOSEN_MARKER = "BATCHINFER_OPENMP_CHOSEN"
# The governor's window, and the share of a core other work must keep busy over it to count as taking it.
GOVERNOR_INTERVAL_S = 1.0
BUSY_CORE_SHARE = 0.4
# A new count is applied when this many consecutive windows agree on it (a short-lived task moves nothing).
GOVERNOR_AGREEING_WINDOWS = 2
# With any of these set libgomp pins its threads; the governor then stays off.
OPENMP_BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")
logger = logging.getLogger(__name__)


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
    if applied:  # merged with what a parent process chose (inherited with the variables)
        inherited = set(filter(None, env.get(CHOSEN_MARKER, "").split(",")))
        env[CHOSEN_MARKER] = ",".join(sorted(inherited | set(applied)))
    return applied


def governor_ceiling(current: int, environ: MutableMapping[str, str] | None = None) -> int:
    """The most threads the governor may run (all cores where batchinfer chose the count, else it).

    configure_openmp_env may have taken one thread fewer at start: then every usable core. A count the
    user set (OMP_NUM_THREADS, torch.set_num_threads) is the ceiling.
    """
    env = os.environ if environ is None else environ
    chose = "OMP_NUM_THREADS" in env.get(CHOSEN_MARKER, "").split(",")
    if chose and env.get("OMP_NUM_THREADS") == str(current):
        return usable_cores()
    return current


def busy_cpu_seconds(cpus: set[int], stat_text: str) -> float:
    """CPU time spent busy (not idle / iowait) on `cpus` since boot, from /proc/stat's per-CPU lines.

    Busy = user + nice + system + irq + softirq + steal (guest time is already inside user); a CPU the
    hypervisor stole counts as taken, like one another process holds. A niced job counts too: the
    scheduler gives it less of the core, but our threads still wait at every barrier for the one beside it.
    """
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


def read_proc_stat() -> str:
    """/proc/stat's text ('' where there is none)."""
    try:
        with open(_PROC_STAT) as f:
            return f.read()
    except OSError:
        return ""


def own_cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads."""
    times = os.times()
    return times.user + times.system


def threads_beside(other_busy_cores: float, *, cores: int, ceiling: int) -> int:
    """Threads to run beside other work: one fewer per core it takes, within [1, ceiling].

    A core counts as taken from BUSY_CORE_SHARE of it busy.
    """
    taken = math.floor(other_busy_cores + 1.0 - BUSY_CORE_SHARE)
    return max(1, min(ceiling, cores - taken))


class ThreadGovernor:
    """Re-chooses the engine's thread count while it runs, from what other work did on our CPUs.

    tick() is called once per engine step and costs a clock read until a window (GOVERNOR_INTERVAL_S)
    has passed; then it compares the busy time of our CPUs with our own CPU time over the window.
    Invariant: the count it sets is always within [1, ceiling].
    """

    def __init__(self, *, ceiling: int, set_threads: Callable[[int], None], current: int,
                 cpus: set[int] | None = None, interval_s: float = GOVERNOR_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, read_stat: Callable[[], str] = read_proc_stat,
                 own_cpu: Callable[[], float] = own_cpu_seconds) -> None:
        self.cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        self.ceiling = max(1, min(ceiling, len(self.cpus)))
        self.threads = current
        self.other_busy_cores = 0.0  # over the last window, for metrics and logs
        self._set_threads, self._interval_s, self._clock = set_threads, interval_s, clock
        self._read_stat, self._own_cpu = read_stat, own_cpu
        self._candidate, self._agreeing = current, 0
        self._initial = current
        self._window = self._sample()

    def restore(self) -> None:
        """Set the count back to the one in force when the governor started."""
        if self.threads != self._initial:
            self._set_threads(self._initial)
            self.threads = self._initial

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), busy_cpu_seconds(self.cpus, self._read_stat()), self._own_cpu()

    def tick(self) -> int:
        """Once per step: when a window has passed, re-choose and apply the thread count; the count now."""
        if self._clock() - self._window[0] < self._interval_s:
            return self.threads
        (t0, busy0, own0), (t1, busy1, own1) = self._window, self._sample()
        self._window = (t1, busy1, own1)
        # Our CPU time includes spinning waits, so this undercounts others a little; never below 0.
        self.other_busy_cores = max(0.0, ((busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9))
        wanted = threads_beside(self.other_busy_cores, cores=len(self.cpus), ceiling=self.ceiling)
        self._agreeing = self._agreeing + 1 if wanted == self._candidate else 1
        self._candidate = wanted
        if wanted != self.threads and self._agreeing >= GOVERNOR_AGREEING_WINDOWS:
            logger.info("engine threads %d -> %d: other work keeps %.2f of our %d cores busy",
                        self.threads, wanted, self.other_busy_cores, len(self.cpus))
            self._set_threads(wanted)
            self.threads = wanted
        return self.threads


def cpu_thread_governor(*, adaptive: bool, ranks: int) -> tuple[ThreadGovernor | None, int]:
    """(the governor of a CPU engine, or None where its count stays, the thread count now).

    None when adaptive_threads is off, for TP / PP (each rank gets its own share of the cores), with
    OpenMP threads bound to places, or with nothing to lower (a ceiling of one thread).
    """
    import torch

    current = torch.get_num_threads()
    if not adaptive or ranks > 1 or any(name in os.environ for name in OPENMP_BINDING_VARIABLES):
        return None, current
    ceiling = governor_ceiling(current)
    if ceiling <= 1:
        return None, current
    return ThreadGovernor(ceiling=ceiling, current=current, set_threads=torch.set_num_threads), current
