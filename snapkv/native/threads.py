"""How many threads snapkv's C kernels run with: the cores this process may use, less the ones other processes keep
busy.

Two processes that each run a thread per core on the same cores slow each other down far more than by half. Every
decoded token passes about 240 OpenMP barriers; a thread whose partner has lost its core to the other process waits
at the barrier until the partner runs again. On 2 cores two decodes at once ran at 20 tokens/s each, against 95
alone; with one thread each they ran at 53 each (benchmarks/shared_cores.py, docs/measurements.md).

So the kernels' thread count follows the machine. `threads_now()` is asked at every kernel call. At most every
SAMPLE_SECONDS it reads how long the allowed cores were busy (/proc/stat) and subtracts this process's own CPU time
(time.process_time, all its threads); the count is the cores left over, at least one. When the other process ends,
the next reading gives the cores back. Under a CPU quota (cgroup v2 cpu.max below the allowed cores, as in a
container given fewer CPUs than its host has) /proc/stat counts the host's other tenants, so there the busy time read
is the cgroup's own (cpu.stat's usage_usec: every process in the container) and the cores are the quota's.

Only the C kernels follow it. Each of their outputs is summed by one thread in a fixed order, so their results are
the same whatever the count (tests/test_threads.py). PyTorch's own matrix products are not: at a few rows (a question's)
a product in fp32 differs in its last bits between one thread and two. So torch's thread count is left as it was,
and an answer never depends on how busy the machine is.

The count stays fixed at torch's own (at most the quota's cores) in three cases:
- the machine has no /proc/stat (macOS, Windows);
- a CPU quota is below the allowed cores and its cgroup has no cpu.stat to read;
- SNAPKV_THREADS=N fixes it to N (and then libgomp's spinning is left as it is: snapkv.base.spinning).

How long an idle thread spins before it sleeps is set apart, before torch loads OpenMP: snapkv.base.spinning.
"""

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from snapkv.base.errors import ConfigError
from snapkv.base.spinning import THREADS_SETTING

SETTING = THREADS_SETTING  # SNAPKV_THREADS: auto (the default) or a fixed count
SAMPLE_SECONDS = 0.25       # the shortest window over which other processes' use is measured
IGNORED_USE = 0.25          # cores used by others below this are not worth giving a thread up for
STAT = Path("/proc/stat")
QUOTA = Path("/sys/fs/cgroup/cpu.max")
CGROUP_USAGE = Path("/sys/fs/cgroup/cpu.stat")


def threads_setting() -> int | None:
    """The fixed count SNAPKV_THREADS asks for, None for auto (the default); ConfigError for anything else."""
    chosen = os.environ.get(SETTING, "").strip().lower() or "auto"
    if chosen == "auto":
        return None
    if not chosen.isdigit() or int(chosen) < 1:
        raise ConfigError(f"{SETTING} is 'auto' or a whole number of threads above 0, not {chosen!r}")
    return int(chosen)


@dataclass(frozen=True)
class Sample:
    """One reading: when (monotonic seconds), the allowed cores' busy time and this process's CPU time (seconds)."""
    wall: float
    busy: float
    own: float


def busy_seconds(stat_text: str, cpus: frozenset[int], ticks_per_second: float) -> float:
    """The seconds the CPUs `cpus` have spent on anything but idling, from /proc/stat's text.

    Each `cpuN` line counts ticks of user, nice, system, idle, iowait, irq, softirq, steal, ...; idle and iowait
    are free time. Steal counts as busy: the hypervisor gave that core to someone else.
    """
    busy_ticks = 0
    for line in stat_text.splitlines():
        name, _, counts = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(count) for count in counts.split()]
        busy_ticks += sum(ticks[:8]) - ticks[3] - ticks[4]  # guest time is already inside user
    return busy_ticks / ticks_per_second


def threads_left(most: int, others_cores: float) -> int:
    """The threads to run when other processes keep `others_cores` cores busy on average: at least one."""
    taken = max(0, math.ceil(others_cores - IGNORED_USE))
    return max(1, min(most, most - taken))


def cgroup_busy_seconds(cpu_stat_text: str) -> float | None:
    """The CPU seconds every process in a cgroup has used, from its cpu.stat ("usage_usec N" among other lines)."""
    for line in cpu_stat_text.splitlines():
        name, _, count = line.partition(" ")
        if name == "usage_usec" and count.strip().isdigit():
            return int(count) / 1e6
    return None


def quota_cores(text: str) -> int | None:
    """cgroup v2's cpu.max ("max 100000" or "<quota> <period>") as whole cores, None where unlimited."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


class CoreShare:
    """The thread count for this process, refreshed from a reading of the machine every SAMPLE_SECONDS."""

    def __init__(self, most: int, read_busy: Callable[[], float | None] | None,
                 clock: Callable[[], float] = time.monotonic,
                 own_time: Callable[[], float] = time.process_time) -> None:
        """most: the threads to use alone; read_busy: the CPU seconds the cores this process may use have been busy
        (a reading of /proc/stat or of a cgroup), None (or a reader that finds nothing) to keep `most` fixed."""
        self.most = self.threads = most
        self._read_busy, self._clock, self._own_time = read_busy, clock, own_time
        self._last = self._sample() if read_busy is not None else None
        self._lock = threading.Lock()

    def _sample(self) -> Sample | None:
        busy = self._read_busy()
        if busy is None:
            return None
        return Sample(self._clock(), busy, self._own_time())

    def fit(self) -> int:
        """The threads to use now; reads the machine where the last reading is SAMPLE_SECONDS old."""
        if self._last is None or self._clock() - self._last.wall < SAMPLE_SECONDS:
            return self.threads
        with self._lock:
            now = self._sample()
            if now is None or now.wall - self._last.wall < SAMPLE_SECONDS:
                return self.threads
            others = (now.busy - self._last.busy) - (now.own - self._last.own)  # CPU seconds of other processes
            self.threads = threads_left(self.most, others / (now.wall - self._last.wall))
            self._last = now
        return self.threads


def _proc_stat_reader(cpus: frozenset[int], ticks_per_second: float) -> Callable[[], float | None]:
    """The busy seconds of `cpus` from /proc/stat, None where it cannot be read."""
    def read() -> float | None:
        text = _read(STAT)
        return None if text is None else busy_seconds(text, cpus, ticks_per_second)
    return read


def _cgroup_reader() -> float | None:
    """The busy seconds of this process's cgroup (all its processes), None where it cannot be read."""
    text = _read(CGROUP_USAGE)
    return None if text is None else cgroup_busy_seconds(text)


def _machine_share() -> CoreShare:
    """This process's CoreShare: SNAPKV_THREADS, else torch's own count adjusted to what others use."""
    import torch  # its own count (OMP_NUM_THREADS, else the physical cores) is the most the kernels use

    fixed = threads_setting()
    if fixed is not None:
        return CoreShare(fixed, None)
    most = torch.get_num_threads()
    cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    quota = quota_cores(_read(QUOTA) or "max")
    if quota is not None and cpus is not None and quota < len(cpus):
        return CoreShare(min(most, quota), _cgroup_reader)
    if cpus is None:
        return CoreShare(most, None)
    ticks = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    return CoreShare(most, _proc_stat_reader(cpus, ticks))


_share: CoreShare | None = None
_share_lock = threading.Lock()


def threads_now() -> int:
    """The threads a C kernel called now runs with: this process's share of the cores."""
    global _share
    if _share is None:
        with _share_lock:
            _share = _share or _machine_share()
    return _share.fit()
