"""The shared-memory file behind a node's block pool, from its room check to its mapping.

Whether it fits, who may open it, and creating, locking, naming, preparing and mapping
it (:func:`open_pool`), and whether its path still names it (:func:`replaced`).

The pool file (``<shm_dir>/pegaflow-<node_id>.pool``) is allocated whole when the pool
opens (``posix_fallocate``, then every page is touched), after a check that it fits the
memory left (``MemAvailable``, or the cgroup's limit when lower) and the free space of
``shm_dir`` (:func:`check_room`): a pool that does not fit is refused with the sizes
(:class:`PoolDoesNotFit`) instead of getting the process OOM-killed or dying of SIGBUS
later.  Preparing a large pool takes seconds (about 0.5 s a GiB): it is logged, with its
progress (:func:`prepare`), and a stop asked for meanwhile ends it at the next chunk.  A
new pool file is prepared unnamed (``O_TMPFILE``) and linked at its path only once it is
whole (:func:`open_locked`, :func:`link_prepared`), so a process killed while preparing
it leaves nothing.  One process holds a pool file at a
time (an ``flock``; :class:`PoolInUse`).

Access: the pool file is owner-only (0600), or readable and writable by one group
(0660, ``[node] access_group``) so that engines running as other users can map it
(:func:`resolve_group`, :func:`apply_access`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import grp
import logging
import mmap
import os
import threading
import time
from pathlib import Path

from pegaflow.units import human_bytes

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PREPARE_CHUNK = 256 << 20
"""bytes allocated and touched per step while a pool is prepared"""
PROGRESS_S = 3.0
"""seconds between two progress lines while a pool is prepared"""
MEM_HEADROOM = 256 << 20
"""memory a new pool leaves to the rest of the process and the host"""
_NO_LIMIT = 1 << 60


class PoolInUse(OSError):
    """Another live process holds this pool file."""


class PreparationStopped(Exception):
    """A stop asked for while the pool was being prepared (:func:`prepare`)."""


class PoolDoesNotFit(OSError):
    """The pool is larger than the memory or the space in ``shm_dir`` left for it
    (refused before anything is allocated)."""


def memory_available() -> tuple[int, str]:
    """Bytes of memory this process may still fill, and whose figure it is: the host's
    ``MemAvailable``, or what its cgroup's memory limit leaves when that is lower (a
    container's pool pages count against its limit, not against the host)."""
    info: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    host = info.get("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    cgroup = _cgroup_room()
    if cgroup is not None and cgroup < host:
        return cgroup, "available to its cgroup"
    return host, "available"


def _cgroup_room() -> int | None:
    """What this process's memory cgroup (v2 or v1) and its ancestors still let it
    use (limit less usage, reclaimable file cache counted as free), None without a
    limit or where it cannot be read."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and not ctrls:  # v2
            names = ("memory.max", "memory.current", "inactive_file")
            bases = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")]
        elif "memory" in ctrls.split(","):  # v1
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            bases = [Path("/sys/fs/cgroup/memory")]
        else:
            continue
        for base in bases:
            room = _room_under(base, path, names)
            if room is not None:
                return room
    return None


def _room_under(base: Path, path: str, names: tuple[str, str, str]) -> int | None:
    limit_f, usage_f, inactive_key = names
    parts = [p for p in path.split("/") if p]
    own: Path | None = None
    for i in range(len(parts) + 1):  # inside a cgroup namespace the mount shows a suffix
        d = base.joinpath(*parts[i:])
        with contextlib.suppress(OSError, ValueError):
            if str(os.getpid()) in (d / "cgroup.procs").read_text().split():
                own = d
                break
    if own is None:
        return None
    best: int | None = None
    d = own
    while True:
        with contextlib.suppress(OSError, ValueError):
            raw = (d / limit_f).read_text().strip()
            limit = _NO_LIMIT if raw == "max" else int(raw)
            if limit < _NO_LIMIT:
                usage = int((d / usage_f).read_text())
                inactive = 0
                for line in (d / "memory.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == inactive_key:
                        inactive = int(value)
                room = max(0, limit - usage + inactive)
                best = room if best is None else min(best, room)
        if d == base or d.parent == d:
            return best
        d = d.parent


def _memory_backed(directory: Path) -> bool:
    """Whether files in ``directory`` live in memory (tmpfs, ramfs: a pool there needs
    memory as well as space); True when the mount table cannot tell."""
    try:
        with open("/proc/self/mounts") as fh:
            mounts = [line.split()[1:3] for line in fh if len(line.split()) > 2]
    except OSError:
        return True
    real = os.path.realpath(directory)
    best, fstype = "", ""
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype = point, kind
    return fstype in ("tmpfs", "ramfs") or not best


def room_problem(
    want: int,
    have: int,
    shm_dir: str | Path,
    shm_free: int,
    mem: tuple[int, str] | None,
    flag: str,
) -> str | None:
    """Why a pool of ``want`` bytes does not fit (one line naming the sizes and the
    ``flag`` that sets them), else None.  ``have``: bytes its file holds already (a
    pool re-attached); ``mem``: memory available and whose (None: not memory-backed)."""
    need = max(0, want - have)
    short_mem = mem is not None and need + MEM_HEADROOM > mem[0]
    if need <= shm_free and not short_mem:
        return None
    more = f" ({human_bytes(need)} more than its file holds)" if have else ""
    memory = ""
    if mem is not None:
        memory = (
            f"{human_bytes(mem[0])} of memory {mem[1]} ({human_bytes(MEM_HEADROOM)} of it "
            "left to the host), "
        )
    return (
        f"pool of {human_bytes(want)} does not fit{more}: {memory}{human_bytes(shm_free)} "
        f"free in {shm_dir}; lower {flag}, or make room"
    )


def check_room(path: str | Path, pool_bytes: int, flag: str = "--node-pool-bytes") -> None:
    """Raise :class:`PoolDoesNotFit` when a pool of ``pool_bytes`` at ``path`` cannot be
    backed by the memory and the space of its directory (what a pool file already at
    ``path`` holds counts as its own)."""
    path = Path(path)
    try:
        have = os.stat(path).st_blocks * 512
    except FileNotFoundError:
        have = 0
    st = os.statvfs(path.parent)
    mem = memory_available() if _memory_backed(path.parent) else None
    why = room_problem(pool_bytes, have, path.parent, st.f_bavail * st.f_frsize, mem, flag)
    if why is not None:
        raise PoolDoesNotFit(why)


def resolve_group(name: str) -> int | None:
    """The gid of ``[node] access_group`` (a name or a number; empty: None).  Raises
    ValueError when there is no such group."""
    name = name.strip()
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise ValueError(f"[node] access_group {name!r}: no such group") from None


def apply_access(target: int | str | Path, gid: int | None) -> None:
    """Give ``target`` (a descriptor or a path: the pool file, the control socket)
    read/write access for group ``gid`` (mode 0660), or make it owner-only (0600)
    when ``gid`` is None."""
    try:
        if gid is not None:
            os.chown(target, -1, gid)
        os.chmod(target, 0o660 if gid is not None else 0o600)
    except PermissionError:
        what = f"descriptor {target}" if isinstance(target, int) else str(target)
        raise PermissionError(
            errno.EPERM,
            f"cannot give {what} to group {gid}: this user is not a member of it "
            "(add it, or change [node] access_group)",
        ) from None


def prepare(
    fd: int,
    mm: mmap.mmap,
    path: Path,
    capacity: int,
    *,
    created: bool,
    size_flag: str,
    stop: threading.Event | None = None,
) -> None:
    """Allocate and touch all ``capacity`` bytes of the mapped pool file ``fd`` (``mm``),
    a chunk at a time (logged: a start line, progress every :data:`PROGRESS_S`, the time
    it took).  ``created``: a new file (else one re-attached); ``size_flag``: the option
    named when it does not fit; ``stop`` set: :class:`PreparationStopped` before the
    next chunk (a stop signal is not kept waiting for a large pool's minutes)."""
    size = human_bytes(capacity)
    what = "preparing" if created else "re-attaching"
    log.info("%s pool of %s in %s", what, size, path.parent)
    t0 = shown = time.monotonic()
    allocate = touch = True
    for off in range(0, capacity, PREPARE_CHUNK):
        if stop is not None and stop.is_set():
            done = off * 100 // capacity
            raise PreparationStopped(f"stopped while preparing pool {path} ({done}% done)")
        n = min(PREPARE_CHUNK, capacity - off)
        allocate = allocate and _allocate(fd, path, capacity, size_flag, off, n)
        touch = touch and _prefault(mm, off, n)
        now = time.monotonic()
        if now - shown >= PROGRESS_S:
            shown = now
            log.info("pool %s: %d%% prepared", path, (off + n) * 100 // capacity)
    log.info("pool of %s ready in %.1f s", size, time.monotonic() - t0)


def _allocate(fd: int, path: Path, capacity: int, size_flag: str, off: int, n: int) -> bool:
    """Allocate ``n`` bytes of the file at ``off``; False where the file system
    cannot preallocate (its pages then come at first touch)."""
    try:
        os.posix_fallocate(fd, off, n)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            st = os.statvfs(path.parent)
            raise OSError(
                e.errno,
                f"pool file {path}: pool of {human_bytes(capacity)} does not "
                f"fit ({human_bytes(st.f_bavail * st.f_frsize)} free in "
                f"{path.parent}); lower {size_flag}, or make room",
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return False
    return True


def _prefault(mm: mmap.mmap, off: int, n: int) -> bool:
    """Back ``n`` bytes of the pool at ``off`` with memory now, so puts never pay
    first-touch faults; False where the kernel cannot.

    MADV_POPULATE_WRITE (Linux 5.14+) keeps existing contents, which matters when
    the pool file is re-attached after a restart.  Called through ctypes, which lets
    go of the GIL (``mmap.madvise`` holds it: a chunk's seconds on a slow host stalled
    every thread of the process, the all-in-one server's coordinator with them).
    """
    view = (ctypes.c_char * n).from_buffer(mm, off)
    try:
        return _libc.madvise(ctypes.addressof(view), n, _MADV_POPULATE_WRITE) == 0
    finally:
        del view  # releases the mmap's export, so that it can close


def _lock(fd: int, path: Path) -> None:
    """Hold ``fd``'s pool file for this process (one process per pool file: a second
    one would resize it under the first); closes ``fd`` and raises PoolInUse if taken."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise PoolInUse(
            f"pool file {path} is in use by another process: give each node its own "
            "[node] node_id (or shm_dir)"
        ) from None


def remove_unused(path: Path) -> bool:
    """Delete the pool file at ``path`` unless another live process holds it (then
    PoolInUse); whether there was one."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    _lock(fd, path)
    try:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)
    return True


def open_locked(path: Path) -> tuple[int, bool, bool]:
    """A locked fd of the pool file at ``path``, whether this call created it, and
    whether it is still unnamed (a new file is made with ``O_TMPFILE`` where the file
    system allows: :func:`link_prepared` names it once it is prepared)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            pass
        else:
            _lock(fd, path)
            if os.fstat(fd).st_nlink:
                return fd, False, False
            os.close(fd)  # removed while we waited for it: make a new one
            continue
        try:
            fd = os.open(path.parent, os.O_RDWR | os.O_TMPFILE, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
        else:
            _lock(fd, path)
            return fd, True, True
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # made in between: open that one
        _lock(fd, path)
        return fd, True, False


def link_prepared(fd: int, path: Path) -> None:
    """Name the prepared ``O_TMPFILE`` file ``fd`` at ``path``."""
    fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:  # linkat(AT_SYMLINK_FOLLOW): a dir fd makes os.link use it
        os.link(str(fd), path, src_dir_fd=fds, follow_symlinks=True)
    except FileExistsError:
        raise PoolInUse(
            f"pool file {path} was created by another process meanwhile: give each node "
            "its own [node] node_id (or shm_dir)"
        ) from None
    finally:
        os.close(fds)


def open_pool(
    path: Path,
    capacity: int,
    access_gid: int | None,
    size_flag: str,
    stop: threading.Event | None = None,
) -> tuple[int, mmap.mmap, bool]:
    """The pool file at ``path`` opened (or re-attached), locked, sized to ``capacity``,
    mapped and prepared: its fd, its mapping, and whether this call made it.  Checks
    first that it fits (:func:`check_room`); a failure (or ``stop``: see :func:`prepare`)
    removes a file this call made."""
    check_room(path, capacity, size_flag)
    fd, created, unnamed = open_locked(path)
    mm: mmap.mmap | None = None
    try:
        apply_access(fd, access_gid)
        os.ftruncate(fd, capacity)
        mm = mmap.mmap(fd, capacity, mmap.MAP_SHARED)
        prepare(fd, mm, path, capacity, created=created, size_flag=size_flag, stop=stop)
        if unnamed:
            link_prepared(fd, path)
            unnamed = False
    except BaseException:
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()  # an unnamed file's memory goes with its last mapping
        os.close(fd)
        if created and not unnamed:
            path.unlink(missing_ok=True)
        raise
    return fd, mm, created


def replaced(path: Path, file_id: tuple[int, int]) -> str | None:
    """Why the pool file mapped as ``file_id`` (device, inode) can no longer be shared
    (its path was deleted or now names another file), else None."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"pool file {path} is gone ({e.strerror})"
    if (st.st_dev, st.st_ino) != file_id:
        return f"pool file {path} was replaced by another file"
    return None

