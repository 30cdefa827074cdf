"""Process helpers for the tests (Linux ``/proc``)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses
    return stat[stat.rindex(b")") + 2:].split()[0] not in (b"Z", b"X")
