"""Small facts about processes and mounts, shared by the CLI, the FUSE tools and batch reads."""

from __future__ import annotations

import os

from stripefs.rpc import my_pid

__all__ = ["pid_alive", "mounts", "my_pid"]

def pid_alive(pid: int) -> bool:
    """Is ``pid`` a live process? A zombie (dead, not yet reaped) counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str]]:
    """``(mountpoint, fstype)`` for every line of a mountinfo file, in order."""
    found = []
    with open(mountinfo) as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            fields = left.split()
            if not sep or len(fields) < 5 or not right.split():
                continue
            found.append((_unescape(fields[4]), right.split()[0]))
    return found
