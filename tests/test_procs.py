"""``fsclient.testing.procs``: a paused process has stopped, every thread of it, before
``pause`` returns; ``while_paused`` runs a call against it and gives up after its wait."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from stripefs.fsclient.testing.procs import pause, resume, stopped, while_paused

# Three threads spinning on the CPU besides the main one: a process whose threads are all
# running when the signal comes, the case in which the others run on for a while.
_SPINNER = """
import sys, threading
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("spinning", flush=True)
sys.stdin.readline()
"""


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.fixture
def spinner():
    proc = subprocess.Popen([sys.executable, "-c", _SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "spinning"
    yield proc
    proc.kill()
    proc.wait(10)


def test_every_thread_has_stopped_when_pause_returns(spinner) -> None:
    assert not stopped(spinner.pid)
    for _ in range(20):
        pause(spinner.pid)
        assert stopped(spinner.pid)
        ticks = _cpu_ticks(spinner.pid)
        time.sleep(0.05)
        assert _cpu_ticks(spinner.pid) == ticks, "a thread ran on after pause returned"
        resume(spinner.pid)
        deadline = time.monotonic() + 5
        while stopped(spinner.pid) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not stopped(spinner.pid)


def test_while_paused_answers_or_gives_up_after_its_wait(spinner) -> None:
    assert while_paused(spinner.pid, lambda: stopped(spinner.pid), 5.0) is True
    started = time.monotonic()
    assert while_paused(spinner.pid, lambda: time.sleep(1.0), 0.1) is None
    assert time.monotonic() - started < 5.0
    assert not stopped(spinner.pid)  # resumed on the way out


def test_a_process_gone_counts_as_stopped_and_resume_tolerates_it() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    assert stopped(proc.pid)
    resume(proc.pid)  # no error
