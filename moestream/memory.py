"""What memory this process may use, and what it has used.

``free`` and ``/proc/meminfo`` show the whole machine even inside a cgroup memory
limit; :func:`available_bytes` also reads the cgroup (v2 ``memory.max`` or v1
``memory.limit_in_bytes``) the process belongs to, and returns the smaller figure.
"""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path

from .errors import BudgetError, given

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
    (``memory.max``, ``memory.current``; the smallest ``memory.max`` of the folder and its
    ancestors, since a parent's limit binds its children) or v1 memory folder
    (``memory.limit_in_bytes``, ``memory.usage_in_bytes``, and ``hierarchical_memory_limit``
    of ``memory.stat``) under ``root/sys/fs/cgroup``. ``root`` lets tests use a fake tree.
    """
    found = cgroup_memory_limit(root)
    return None if found is None else (found[0], found[1])


def cgroup_memory_limit(root: Path = Path("/")) -> tuple[int, int, str] | None:
    """``(limit, usage, where)``: as :func:`cgroup_limit_bytes`, plus a description of the
    limit's source (``"cgroup v1 /sys/fs/cgroup/memory/x"``) for messages."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    base = root / "sys/fs/cgroup"
    best: tuple[int, int, str] | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            folder = base / rel
            if not (folder / "memory.max").exists() and (base / "memory.max").exists():
                folder = base  # a cgroup namespace: our cgroup is the root of the mount
            usage = _read_int(folder / "memory.current") or 0
            node = folder
            while True:
                limit = _read_int(node / "memory.max")
                if limit is not None and limit < _UNLIMITED and (best is None or limit < best[0]):
                    best = (limit, usage, f"cgroup v2 {node}")
                if node == base or base not in node.parents:
                    break
                node = node.parent
        elif "memory" in controllers.split(","):
            folder = base / "memory" / rel
            if not folder.is_dir():
                folder = base / "memory"
            usage = _read_int(folder / "memory.usage_in_bytes") or 0
            limits = [_read_int(folder / "memory.limit_in_bytes")]
            try:
                for stat in (folder / "memory.stat").read_text().splitlines():
                    if stat.startswith("hierarchical_memory_limit "):
                        limits.append(int(stat.split()[1]))
            except (OSError, ValueError, IndexError):
                pass
            for limit in limits:
                if limit is not None and limit < _UNLIMITED and (best is None or limit < best[0]):
                    best = (limit, usage, f"cgroup v1 {folder}")
    return best


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


# -- the cache budget "auto" -------------------------------------------------------------
# Tests point this at a fake tree (proc/self/cgroup, proc/meminfo, sys/fs/cgroup/...).
SYSTEM_ROOT = Path("/")
def available_with_source(root: Path | None = None) -> tuple[int, str]:
    """(bytes this process can still take, where the figure comes from), as :func:`available_bytes`."""
    root = SYSTEM_ROOT if root is None else root
    avail = _meminfo_available(root)
    source = f"MemAvailable {avail / 1e9:.2f} GB" if avail is not None else "free pages"
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    cg = cgroup_memory_limit(root)
    if cg is not None:
        limit, _, where = cg
        rss = current_rss_bytes()
        if limit - rss < avail:
            avail = max(0, limit - rss)
            source = f"{where} limit {limit / 1e9:.2f} GB less this process's RSS {rss / 1e9:.2f} GB"
    return avail, source


# -- --wire-memory: mlock -------------------------------------------------------------------
_CAP_IPC_LOCK = 14


def has_cap_ipc_lock(root: Path | None = None) -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (``CAP_IPC_LOCK`` in CapEff)."""
    root = SYSTEM_ROOT if root is None else root
    try:
        for line in (root / "proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def check_memlock(need: int, root: Path | None = None, name: str = "--wire-memory") -> None:
    """Refuse ``--wire-memory`` (``name``: as the caller gave it) up front when ``need`` bytes cannot be locked.

    Raises:
        BudgetError: when RLIMIT_MEMLOCK is below ``need`` and the process lacks
            ``CAP_IPC_LOCK``, naming both numbers and how to raise the limit.
    """
    limit = memlock_limit()
    if limit is None or limit >= need or has_cap_ipc_lock(root):
        return
    name = given(name, True)  # --wire-memory, wire_memory=True
    raise BudgetError(
        f"{name}: locking the resident weights and the cache needs {need / 1e9:.2f} GB, but the memlock "
        f"limit (RLIMIT_MEMLOCK, `ulimit -l`) is {limit / 1e9:.3g} GB ({limit // 1024} KiB); raise it "
        f"(`ulimit -l unlimited`, memlock in /etc/security/limits.conf, or LimitMEMLOCK= for a service) or drop "
        f"{name}"
    )


class WiredMemory:
    """Locks memory in RAM with ``mlock(2)`` (``--wire-memory``): resident weights, cached experts.

    Ranges are rounded out to whole pages. An expert's ranges are unlocked when the
    store releases it (its mapping is then recycled or unmapped, which unlocks it too).

    Attributes:
        locked_bytes: bytes currently locked through this object.

    Raises (from the lock methods):
        BudgetError: when the kernel refuses (RLIMIT_MEMLOCK reached), with the numbers.
    """

    def __init__(self):
        import ctypes

        self._ctypes = ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._experts: dict = {}
        self._lock = threading.Lock()
        self.locked_bytes = 0

    def _span(self, addr: int, nbytes: int) -> tuple[int, int]:
        start = addr - addr % self._page
        return start, -(-(addr + nbytes - start) // self._page) * self._page

    def lock_range(self, addr: int, nbytes: int, what: str) -> int:
        """mlock ``nbytes`` at ``addr``; returns the bytes locked (whole pages)."""
        start, length = self._span(addr, nbytes)
        if self._libc.mlock(self._ctypes.c_void_p(start), self._ctypes.c_size_t(length)) != 0:
            err = self._ctypes.get_errno()
            limit = memlock_limit()
            raise BudgetError(
                f"--wire-memory: mlock of {what} ({length / 1e6:.1f} MB) failed ({os.strerror(err)}) with "
                f"{self.locked_bytes / 1e9:.2f} GB already locked; the memlock limit (RLIMIT_MEMLOCK, `ulimit -l`) "
                f"is {'unlimited' if limit is None else f'{limit // 1024} KiB'}: raise it or drop --wire-memory"
            )
        with self._lock:
            self.locked_bytes += length
        return length

    def unlock_range(self, addr: int, nbytes: int) -> int:
        start, length = self._span(addr, nbytes)
        self._libc.munlock(self._ctypes.c_void_p(start), self._ctypes.c_size_t(length))
        with self._lock:
            self.locked_bytes -= length
        return length

    def lock_tensors(self, tensors, what: str) -> None:
        """Lock the storage of each tensor (shared storages once)."""
        seen = set()
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in seen and st.nbytes():
                seen.add(st.data_ptr())
                self.lock_range(st.data_ptr(), st.nbytes(), what)

    def lock_expert(self, key, tensors, mapping) -> None:
        """Lock one expert handed out by the store: its read buffer (``mapping``) and any
        tensors that live outside it (cast to the compute dtype or moved)."""
        ranges = []
        if mapping is not None:
            addr = self._ctypes.addressof(self._ctypes.c_char.from_buffer(mapping))
            ranges.append((addr, len(mapping)))
        ranges += [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors
                   if t.device.type == "cpu" and t.untyped_storage().nbytes()]
        for addr, n in ranges:
            self.lock_range(addr, n, f"expert {key}")
        with self._lock:
            self._experts.setdefault(key, []).extend(ranges)

    def unlock_expert(self, key) -> None:
        with self._lock:
            ranges = self._experts.pop(key, [])
        for addr, n in ranges:
            self.unlock_range(addr, n)
