"""Who made a file, in its name, and whether that process is provably gone.

NOTE [file owners]: a file another process may find after its maker died (a cache
download's temp, a transform slot in ``/dev/shm``) carries its maker in its name:
``<owner>`` = ``<host>-<boot>-<pidns>`` (``owner()``: the host name made of ``[A-Za-z0-9_]``
and at most 32 long, the first 16 hex digits of the kernel's boot id, the inode of the
pid namespace) and the maker's pid. A pid means something only in its own pid namespace
of its own boot: containers share a host's ``/dev/shm`` (``--ipc=host``) and a file
server's directories while each numbers its processes from 1, so "no process has this
pid here" proves nothing about a file made elsewhere. ``owner_gone`` says True (gone)
only when the name's boot id and pid namespace are this process's and the pid is gone
(or a zombie), or the name is of an earlier boot of this host (every process of it is
gone); False when the pid is alive here; None when it cannot tell (another host, another
pid namespace, a boot id that could not be read). The boot id and namespace inode name
one namespace of one running kernel, so the host name adds nothing to that proof (a
container may have a host name of its own); it tells an earlier boot of this host from
another host. Each user decides what None means: the cache reclaims such a temp once it
is an hour old (NOTE [cache publish]); the process executor never removes it.
"""

from __future__ import annotations

import os
import re

# <host>-<boot>-<pidns>, as owner() writes it.
OWNER_PATTERN = r"[A-Za-z0-9_]{1,32}-(?:[0-9a-f]{16}|0)-[0-9]+"
_OWNER_RE = re.compile(rf"^{OWNER_PATTERN}$")

_owner_cache: tuple[int, str] | None = None


def boot_id() -> str:
    """The first 16 hex digits of this kernel's boot id, or "0" where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            b = f.read().strip().replace("-", "")[:16].lower()
    except OSError:
        return "0"
    return b if len(b) == 16 and all(c in "0123456789abcdef" for c in b) else "0"


def owner() -> str:
    """``<host>-<boot>-<pidns>`` of this process (NOTE [file owners])."""
    global _owner_cache
    pid = os.getpid()
    if _owner_cache is None or _owner_cache[0] != pid:
        host = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in os.uname().nodename)[:32]
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ns = 0
        _owner_cache = (pid, f"{host or '_'}-{boot_id()}-{ns}")
    return _owner_cache[1]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process in this pid namespace (a zombie is dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: someone else's live process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def owner_gone(name_owner: str, pid: int) -> bool | None:
    """Whether process ``pid`` of ``name_owner`` (``<host>-<boot>-<pidns>``) is gone.

    True or False, or None where this process cannot tell (NOTE [file owners]).
    """
    if not _OWNER_RE.match(name_owner):
        return None
    host, boot, ns = name_owner.split("-")
    my_host, my_boot, my_ns = owner().split("-")
    if boot != "0" and boot == my_boot:
        if ns == my_ns and ns != "0":
            return not pid_alive(pid)
        return None  # another pid namespace of this kernel: its pids are not ours
    if boot != "0" and my_boot != "0" and host == my_host:
        return True  # an earlier boot of this host: every process of it is gone
    return None


__all__ = ["OWNER_PATTERN", "boot_id", "owner", "pid_alive", "owner_gone"]
