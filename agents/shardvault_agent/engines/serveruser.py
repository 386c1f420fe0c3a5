"""The OS account a database server runs as when the agent is root (``postgres``, ``mysql``):
servers refuse to run as root, so their files must be that account's, and it must be able to
*traverse* (search, ``x``) every ancestor of their directories. As non-root everything runs as
the current user and these are no-ops.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile
from pathlib import Path

# sun_path is 108 bytes including the NUL: servers refuse longer socket paths.
SOCKET_PATH_MAX = 107


class ServerUserMissing(RuntimeError):
    """No OS account to run a server as."""


class NotTraversable(PermissionError):
    """The server's OS account cannot reach a directory."""


def as_root() -> bool:
    return os.geteuid() == 0


def user_ids(user: str) -> tuple[int, int, set[int]]:
    """uid, primary gid and all group ids of ``user``."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ServerUserMissing(
            f"There is no '{user}' OS user to run servers as (we are root). Fix: run "
            "scripts/setup.sh, or install the server's Debian package (it creates the user)."
        ) from None
    groups = {entry.pw_gid} | {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}
    return entry.pw_uid, entry.pw_gid, groups


def give_to(user: str, path: Path) -> None:
    """Makes ``path`` the account's (as root)."""
    if as_root():
        uid, gid, _ = user_ids(user)
        os.chown(path, uid, gid, follow_symlinks=False)


def _searchable_by(st: os.stat_result, uid: int, groups: set[int]) -> bool:
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _under_temp(path: Path) -> bool:
    temp = Path(tempfile.gettempdir()).resolve()
    return path != temp and path.is_relative_to(temp)


def ensure_traversable(path: Path, user: str, created: frozenset[Path] = frozenset()) -> None:
    """Makes sure ``user`` can reach ``path`` (as root; a no-op otherwise).

    Ancestors we just ``created`` and our own directories under the temp dir (pytest's
    ``/tmp/pytest-of-root`` is 0700) get search permission for others: ``o+x`` lets the
    account pass through without listing them. Anything else (``/root`` is typically 0700) is
    not ours to loosen: that is a :class:`NotTraversable` saying what to do.
    """
    if not as_root():
        return
    uid, _, groups = user_ids(user)
    for directory in reversed([path, *path.parents]):
        st = directory.stat()
        if _searchable_by(st, uid, groups):
            continue
        if directory in created or (st.st_uid == os.geteuid() and _under_temp(directory)):
            directory.chmod(stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
            continue
        raise NotTraversable(
            f"The '{user}' OS user cannot reach {path}: {directory} is "
            f"{stat.filemode(st.st_mode)} (owner uid {st.st_uid}). Fix: put the server's "
            f"directories under a traversable directory such as {tempfile.gettempdir()}, or "
            f"grant search permission with 'chmod o+x {directory}'."
        )


def make_dirs(path: Path) -> frozenset[Path]:
    """``mkdir -p``; returns the directories it created."""
    path = path.absolute()
    missing = [d for d in [path, *path.parents] if not d.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return frozenset(missing)
