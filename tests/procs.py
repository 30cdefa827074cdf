"""Process helpers for the tests (Linux ``/proc``)."""

from __future__ import annotations

import os
from pathlib import Path


def _state(stat_file: Path) -> bytes | None:
    try:
        stat = stat_file.read_bytes()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses
    return stat[stat.rindex(b")") + 2:].split()[0]


def alive(pid: int) -> bool:
    """Whether any thread of process ``pid`` still runs; ``False`` once its parent's ``waitpid``
    can report it (or it is gone).

    The main thread of a process that called ``_exit`` shows as a zombie at once, while another of
    its threads may still be exiting: the last one out frees the address space (0.16-0.20 s for
    3 GB on the 2-core machine), and ``waitpid`` reports the process only after that. Reading the
    main thread's state alone, CI's host test once ran its next prompt inside that gap and saw the
    server's ``Popen.poll()`` still answer ``None``."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    states = [_state(Path(f"/proc/{pid}/task/{tid}/stat")) for tid in tasks]
    return any(s is not None and s not in (b"Z", b"X") for s in states)
