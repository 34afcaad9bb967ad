"""The thread count follows the cores other processes leave free (snapkv.native.threads): read from /proc/stat's busy
time less this process's own, refreshed at most every SAMPLE_SECONDS; fixed by SNAPKV_THREADS, a CPU quota, or a
machine without /proc/stat. benchmarks/shared_cores.py measures what it buys."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snapkv import native
from snapkv.base.errors import ConfigError
from snapkv.native import threads
from snapkv.native.threads import (CoreShare, busy_seconds, cgroup_busy_seconds, quota_cores, threads_left,
                                   threads_setting)
from snapkv.engine.working_cache import WorkingCache

SAMPLE = Path(__file__).parent.parent / "samples" / "annual_report.txt"


def stat_text(busy_ticks: dict[int, int], idle_ticks: int = 1000) -> str:
    """A /proc/stat with one `cpuN` line per core: its busy ticks split over user, system, irq and steal."""
    lines = [f"cpu  {sum(busy_ticks.values())} 0 0 {idle_ticks * len(busy_ticks)} 0 0 0 0 0 0"]
    for cpu, ticks in busy_ticks.items():
        user, system, irq, steal = ticks - ticks // 2, ticks // 4, ticks // 8, ticks // 2 - ticks // 4 - ticks // 8
        lines.append(f"cpu{cpu} {user} 0 {system} {idle_ticks} 7 {irq} 0 {steal} 3 0")  # guest (3) is in user
    return "\n".join(lines + ["intr 1 2 3", "procs_running 3"]) + "\n"


def test_busy_time_is_read_for_the_allowed_cores_only():
    text = stat_text({0: 200, 1: 100, 2: 5000})
    assert busy_seconds(text, frozenset({0, 1}), 100.0) == 3.0  # cpu2 is not ours; idle and iowait are free
    assert busy_seconds(text, frozenset({2}), 100.0) == 50.0


def test_other_processes_use_takes_threads_away_down_to_one():
    assert threads_left(4, 0.0) == 4 and threads_left(4, 0.2) == 4  # a shell's glance is not worth a thread
    assert threads_left(4, 0.9) == 3 and threads_left(4, 1.3) == 2
    assert threads_left(2, 1.0) == 1 and threads_left(2, 7.0) == 1


def test_a_cpu_quota_is_read_in_whole_cores():
    assert quota_cores("max 100000\n") is None
    assert quota_cores("200000 100000\n") == 2 and quota_cores("150000 100000") == 2 and quota_cores("1000 100000") == 1


class Machine:
    """A clock, this process's CPU time and /proc/stat's text, moved on by hand."""

    def __init__(self) -> None:
        self.wall, self.own, self.busy = 0.0, 0.0, {0: 0, 1: 0}

    def spend(self, seconds: float, own_cores: float, other_cores: float) -> None:
        """`seconds` pass with this process busy on own_cores and others on other_cores (spread over both CPUs)."""
        self.wall += seconds
        self.own += own_cores * seconds
        for cpu in self.busy:
            self.busy[cpu] += round((own_cores + other_cores) * seconds * 100 / len(self.busy))

    def share(self) -> CoreShare:
        return CoreShare(2, lambda: busy_seconds(stat_text(self.busy), frozenset(self.busy), 100.0),
                         clock=lambda: self.wall, own_time=lambda: self.own)


def test_the_threads_follow_what_another_process_uses_and_come_back_when_it_stops():
    machine = Machine()
    share = machine.share()
    assert share.fit() == 2
    machine.spend(1.0, own_cores=2.0, other_cores=0.0)  # alone
    assert share.fit() == 2
    machine.spend(1.0, own_cores=1.0, other_cores=1.0)  # another decode takes a core
    assert share.fit() == 1
    machine.spend(0.1, own_cores=1.0, other_cores=0.0)  # too soon to read again
    assert share.fit() == 1
    machine.spend(0.5, own_cores=1.0, other_cores=0.0)  # the other one has ended
    assert share.fit() == 2


def test_a_machine_without_proc_stat_keeps_the_count_it_started_with():
    share = CoreShare(2, lambda: None)
    assert share.fit() == 2 and share.fit() == 2
    assert CoreShare(3, None).fit() == 3


def test_under_a_cpu_quota_the_cgroups_own_use_is_read_against_the_quotas_cores(monkeypatch, tmp_path):
    """A container given 2 CPUs on a 4-core host: the count starts at the quota's 2 and follows what the container's
    other processes use (its cpu.stat), not the host's other tenants in /proc/stat."""
    assert cgroup_busy_seconds("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n") == 2.5
    assert cgroup_busy_seconds("nr_periods 0\n") is None
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    usage = tmp_path / "cpu.stat"
    usage.write_text("usage_usec 1000000\n")
    monkeypatch.setattr(threads, "QUOTA", tmp_path / "cpu.max")
    monkeypatch.setattr(threads, "CGROUP_USAGE", usage)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.delenv("SNAPKV_THREADS", raising=False)
    share = threads._machine_share()
    assert share.most == 2 and share._read_busy() == 1.0

    wall, own = [0.0], [0.0]
    share = CoreShare(2, lambda: cgroup_busy_seconds(usage.read_text()), clock=lambda: wall[0],
                      own_time=lambda: own[0])
    wall[0], own[0] = 1.0, 1.0
    usage.write_text("usage_usec 3000000\n")  # this process 1 core-second, another in the container the other
    assert share.fit() == 1
    wall[0], own[0] = 2.0, 3.0
    usage.write_text("usage_usec 5000000\n")  # this process alone again on both
    assert share.fit() == 2


def test_snapkv_threads_fixes_the_count_and_a_bad_value_is_a_config_error(monkeypatch):
    monkeypatch.setenv("SNAPKV_THREADS", "1")
    assert threads_setting() == 1
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_share", None)
    assert threads.threads_now() == 1 and torch.get_num_threads() == before  # torch's own count is left alone
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv("SNAPKV_THREADS", bad)
        with pytest.raises(ConfigError, match="SNAPKV_THREADS"):
            threads_setting()
    monkeypatch.setenv("SNAPKV_THREADS", "Auto")
    assert threads_setting() is None


def test_a_bad_snapkv_threads_stops_a_command_before_it_loads_anything(snapkv_home):
    environment = {**os.environ, "SNAPKV_HOME": str(snapkv_home), "SNAPKV_NO_SERVER": "1", "SNAPKV_THREADS": "lots"}
    result = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", str(SAMPLE), "q"], capture_output=True,
                            text=True, env=environment, timeout=300)
    assert result.returncode != 0 and "SNAPKV_THREADS is 'auto' or a whole number" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(native.variant() is None, reason="the C kernels do not build here")
def test_the_kernels_give_the_same_bits_whatever_their_thread_count(monkeypatch):
    """A question's pass (its layers' parts in C, the cut's scores in C) and decoded tokens (decode_token) on a tiny
    model on blocks, with the kernels on one thread and on two: the same logits to the bit, the same positions kept."""
    from snapkv.compression.compress import CompressionPlan
    from snapkv.compression.config import Cut
    from snapkv.engine import native_decode, native_question
    from snapkv.engine.generation import prefill
    from snapkv.modeling.presized import presize
    from test_native_decode import PROMPT, QUESTION, ids, on_blocks

    model = on_blocks(num_attention_heads=4, num_key_value_heads=2)
    cache = prefill(model, ids(PROMPT, 1), None)
    runs = []
    for count in (1, 2):
        monkeypatch.setattr(threads, "_share", CoreShare(count, None))
        working = WorkingCache.of(cache, model.config)
        plan = CompressionPlan(Cut(64, 8), window=QUESTION)
        logits = [native_question.question_pass(model, ids(QUESTION, 2), PROMPT, working, plan,
                                                native_decode.question_layers(model))]
        presize(working, 8)
        stepper = native_decode.for_cache(model, working, PROMPT + QUESTION, 8)
        assert stepper is not None
        logits += [stepper.step(token, PROMPT + QUESTION + step) for step, token in enumerate([5, 17, 99, 3])]
        runs.append((logits, plan.kept))
    (one, kept_one), (two, kept_two) = runs
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert kept_one.keys() == kept_two.keys() and all(torch.equal(kept_one[i], kept_two[i]) for i in kept_one)


def test_idle_openmp_threads_spin_less_unless_the_user_said_otherwise():
    from snapkv.base.spinning import SETTING, SPINS, bound_the_spinning

    environ: dict[str, str] = {}
    assert bound_the_spinning(environ, torch_loaded=False) and environ == {SETTING: SPINS}
    for users in ({SETTING: "0"}, {"OMP_WAIT_POLICY": "active"}, {"SNAPKV_THREADS": "2"}, {"SNAPKV_THREADS": " 1"}):
        environ = dict(users)
        assert not bound_the_spinning(environ, torch_loaded=False) and environ == users
    environ = {"SNAPKV_THREADS": "Auto"}  # a fitted count, as with none
    assert bound_the_spinning(environ, torch_loaded=False) and environ == {"SNAPKV_THREADS": "Auto", SETTING: SPINS}
    environ = {}
    assert not bound_the_spinning(environ, torch_loaded=True) and environ == {}  # libgomp has read its settings


def test_importing_snapkv_sets_the_spin_count_before_torch_loads_openmp():
    """In a fresh interpreter, as the CLI starts: snapkv first, then torch (which loads libgomp, reading the setting)."""
    from snapkv.base.spinning import THREADS_SETTING, USERS_SETTINGS

    code = "import os, sys, snapkv; print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))"
    environ = {name: value for name, value in os.environ.items() if name not in (*USERS_SETTINGS, THREADS_SETTING)}
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)
    assert fresh.stdout.split() == ["False", "30000"], fresh.stderr
    users = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**environ, "GOMP_SPINCOUNT": "123"})
    assert users.stdout.split() == ["False", "123"], users.stderr
