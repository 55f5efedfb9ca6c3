"""The process's own peak resident memory.

``getrusage(RUSAGE_SELF).ru_maxrss`` is not it on Linux: the kernel carries the high-water mark across
``execve``, and a child started from a process (``subprocess``, a benchmark's driver, a test runner, a
notebook's kernel) shares its parent's memory until it execs, so its ``ru_maxrss`` starts at the parent's
peak: a 10 MiB child of a 2 GiB parent reports 2 GiB. ``VmHWM`` in ``/proc/self/status`` belongs to the
process's own address space, made new at exec; it is read where there is one, ``ru_maxrss`` elsewhere.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """This process's peak resident set, in bytes (``VmHWM``; ``ru_maxrss`` where there is no ``/proc``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (KiB on Linux, bytes on macOS)
