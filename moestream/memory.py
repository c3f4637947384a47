"""What memory this process may use, and what it has used.

``free`` and ``/proc/meminfo`` show the whole machine even inside a cgroup memory
limit; :func:`available_bytes` also reads the cgroup (v2 ``memory.max`` or v1
``memory.limit_in_bytes``) the process belongs to, and returns the smaller figure.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

_UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def reset_peak_rss() -> bool:
    """Restart the peak-RSS count from the current RSS (Linux ``/proc/self/clear_refs``).

    Returns False where the kernel does not allow it; :func:`peak_rss_bytes` then reports
    the peak over the whole process lifetime.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes, since the last :func:`reset_peak_rss`.

    Reads ``VmHWM`` from ``/proc/self/status``; falls back to ``getrusage`` (lifetime peak).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _meminfo_available(root: Path) -> int | None:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_limit_bytes(root: Path = Path("/")) -> tuple[int, int] | None:
    """``(limit, usage)`` in bytes of this process's cgroup memory limit, or None if unlimited.

    Reads ``/proc/self/cgroup`` under ``root`` and then the matching cgroup v2 folder
    (``memory.max``, ``memory.current``) or v1 memory folder (``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``) under ``root/sys/fs/cgroup``. ``root`` lets tests use a
    fake tree.
    """
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    base = root / "sys/fs/cgroup"
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            folder = base / rel
            limit = _read_int(folder / "memory.max")
            usage = _read_int(folder / "memory.current")
        elif "memory" in controllers.split(","):
            folder = base / "memory" / rel
            if not folder.is_dir():
                folder = base / "memory"
            limit = _read_int(folder / "memory.limit_in_bytes")
            usage = _read_int(folder / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < _UNLIMITED:
            return limit, usage or 0
    return None


def available_bytes(root: Path = Path("/")) -> int:
    """Bytes this process can still take: the smaller of MemAvailable and the cgroup headroom.

    Page cache in a cgroup is reclaimable, so the cgroup headroom counts the limit minus
    this process's resident set, not minus the cgroup's charged usage.
    """
    avail = _meminfo_available(root)
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    cg = cgroup_limit_bytes(root)
    if cg is not None:
        limit, _ = cg
        avail = min(avail, max(0, limit - current_rss_bytes()))
    return avail


def current_rss_bytes() -> int:
    """Current resident set size of this process, in bytes."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
