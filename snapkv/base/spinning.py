"""How long an idle OpenMP thread spins before it sleeps, set for the process before PyTorch loads libgomp.

PyTorch and snapkv's C kernels share one OpenMP runtime (libgomp, loaded with torch), which reads its settings once,
when it loads. By default a thread that waits at a barrier spins about 300,000 times before it sleeps; on an Intel
CPU, whose `pause` takes about 140 cycles, that is several milliseconds of a core held for nothing. Beside another
process on the same cores that is what hurts: a bf16 prefill on AMX next to a decode kept 0.22-0.32 of its alone
speed, its waiting thread holding the core its partner needed (docs/measurements.md, Two processes on the same
cores). At 30,000 spins it kept 0.49 and the decode beside it more, while alone neither the prefill nor the decode
moved beyond the run-to-run noise. Where to wait never changes a result, only who gets the core.

A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is, and so is a process that loaded torch first. So is
a process whose kernels' thread count is fixed by SNAPKV_THREADS (snapkv.native.threads): two such processes on the
same cores, each with a thread per core, decoded at 4 tokens/s each with 30,000 spins and at 19-28 with libgomp's own
(AMD EPYC); fitted counts, the default, keep half their speed either way.
"""

import os
import sys
from collections.abc import MutableMapping

SETTING = "GOMP_SPINCOUNT"
SPINS = "30000"
USERS_SETTINGS = (SETTING, "OMP_WAIT_POLICY")
THREADS_SETTING = "SNAPKV_THREADS"  # snapkv.native.threads reads it: a count there is fixed, "auto" fits it


def bound_the_spinning(environ: MutableMapping[str, str] = os.environ, torch_loaded: bool | None = None) -> bool:
    """Set GOMP_SPINCOUNT to SPINS where neither it nor OMP_WAIT_POLICY is set, the kernels' thread count is not
    fixed by SNAPKV_THREADS and torch is not yet loaded (later it would be read by no one); True where it was set."""
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    fixed_threads = environ.get(THREADS_SETTING, "").strip().lower() not in ("", "auto")
    if torch_loaded or fixed_threads or any(name in environ for name in USERS_SETTINGS):
        return False
    environ[SETTING] = SPINS
    return True
