"""Atomic, non-clobbering writes: nothing on disk is half-written or silently overwritten."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from toolkit.errors import UserError

_INTERRUPT_CLEANUPS: list = []
"""What to undo if Ctrl-C ends the process at once (toolkit.cli's handler, where raising is unsafe): removals of the
staging folders, temporary files and locks being written now, newest first."""


@contextlib.contextmanager
def undone_if_interrupted(cleanup) -> Iterator[None]:
    """Run `cleanup` (a callable) if the process is stopped by Ctrl-C while the block runs (run_interrupt_cleanups);
    the block's own `finally` covers every other way out."""
    _INTERRUPT_CLEANUPS.append(cleanup)
    try:
        yield
    finally:
        _INTERRUPT_CLEANUPS.remove(cleanup)


def run_interrupt_cleanups() -> None:
    for cleanup in reversed(list(_INTERRUPT_CLEANUPS)):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - best effort on the way out; the next writer removes a staging leftover
            pass


def refuse_overwrite(paths: list[Path], force: bool) -> None:
    """Raise before writing anything if any target exists and --force was not given."""
    if force:
        return
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise UserError(f"{existing[0]} already exists ({len(existing)} file(s) would be overwritten); "
                        "pass --force to overwrite or choose another --out")


def check_folder_path(folder: Path, what: str) -> None:
    """A folder we are to create or write: refused when it, or a folder on its way, is a file (mkdir would fail
    half-way, after other steps ran), or when it exists read-only (its owner made it so: we neither write into it
    nor swap in a writable copy)."""
    import stat

    folder = Path(folder).expanduser()
    for parent in (folder, *folder.parents):
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise UserError(f"{what} {folder} is a file; give a folder (it is created if missing)"
                                if parent == folder else
                                f"{what} {folder} is under a file: {parent} is a file; give a folder")
            break
    if folder.is_dir() and not folder.stat().st_mode & stat.S_IWUSR:
        raise UserError(f"{what} {folder} is read-only (mode {stat.S_IMODE(folder.stat().st_mode):o}); make it "
                        "writable (chmod u+w) or choose another folder")


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write `text` to a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)

    def remove_tmp() -> None:
        if os.path.exists(tmp):
            os.unlink(tmp)

    try:
        with undone_if_interrupted(remove_tmp):
            with os.fdopen(fd, "w") as f:
                f.write(text)
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, path)
    except BaseException:
        remove_tmp()
        raise


# ----------------------------------------------------------------------------------------------------------------
# Reading what the user points at: the kind of file first, then at most a stated number of bytes

MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""The most a config, plan.json or DeepSpeed / accelerate file may hold: the largest emitted one is a few KiB, and
a real HF config.json (with its id2label maps) stays under 1 MiB; 16 MiB leaves room and stops /dev/zero."""


def file_kind_problem(path: Path) -> str | None:
    """What `path` is when it is not a regular file ("a directory", "a FIFO (named pipe)", ...), None for a
    regular file or a path that does not exist. Follows symlinks (a plan.json linked to /dev/zero is a device)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, what in ((stat.S_ISREG, None), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def read_bytes_limited(path: Path, what: str, *, limit: int = MAX_CONFIG_BYTES, streams: bool = False) -> bytes:
    """The bytes of the file `what` names (e.g. "plan file"), refused as one line when it is missing, a directory,
    a FIFO or a device, or larger than `limit`. streams=True also reads a pipe (a shell's process substitution
    /dev/fd/N, or "-" for stdin) up to the same limit."""
    import sys

    if str(path) == "-" and streams:
        data = sys.stdin.buffer.read(limit + 1)
        if len(data) > limit:
            raise UserError(f"{what} on stdin is larger than {limit // (1024 * 1024)} MiB; it cannot be a {what}")
        return data
    path = Path(path)
    problem = file_kind_problem(path)
    if problem in ("a FIFO (named pipe)", "a socket") and streams:
        problem = None
    if problem is not None:
        raise UserError(f"{what} {path} is {problem}, not a file; give the file itself")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > limit:
        raise UserError(f"{what} {path} is larger than {limit // (1024 * 1024)} MiB; it cannot be a {what} (is it "
                        "the right file?)")
    return data


def os_error_line(exc: OSError, doing: str) -> str:
    """One line for a failed write: ENOSPC and EACCES / EROFS named with what to do about them."""
    import errno

    fixes = {errno.ENOSPC: "the disk is full; free space or choose a folder on another disk",
             errno.EDQUOT: "the disk quota is exhausted; free space or choose another folder",
             errno.EACCES: "permission denied; choose a folder you can write to",
             errno.EPERM: "operation not permitted; choose a folder you can write to",
             errno.EROFS: "the file system is read-only; choose a folder on a writable disk"}
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    return f"cannot {doing}{where}: {fixes.get(exc.errno, exc.strerror or type(exc).__name__)}"


# ----------------------------------------------------------------------------------------------------------------
# Locks: one writer per folder, with the owner named in the refusal


class FolderLock:
    """An exclusive, non-blocking lock held by this process: a lock file holding the owner's pid and host, locked
    with flock. The kernel drops a flock when its owner dies, so the lock of a crashed (even SIGKILLed) owner is
    taken over without any guess about pids; the pid and host in the file only make the refusal readable."""

    def __init__(self, lock_path: Path, what: str):
        self.path = Path(lock_path)
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        """Take the lock; a full disk or a folder we may not write is one line (UserError), and leaves no lock
        file behind."""
        try:
            return self._acquire()
        except OSError as exc:
            raise UserError(os_error_line(exc, f"lock {self.what}")) from None

    def _acquire(self) -> "FolderLock":
        import fcntl
        import json
        import socket

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise UserError(f"{self.what} is in use by {owner} (lock {self.path}); wait for it to finish or "
                                "stop it, or choose another folder") from None
            # A releasing owner unlinks the file before unlocking; the file we locked must still be the one there.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        except OSError:
            os.unlink(self.path)  # ours: we hold its flock
            os.close(fd)
            raise
        self._fd = fd
        _INTERRUPT_CLEANUPS.append(self.release)
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        if self.release in _INTERRUPT_CLEANUPS:
            _INTERRUPT_CLEANUPS.remove(self.release)

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_owner(fd: int) -> str:
    import json

    try:
        os.lseek(fd, 0, os.SEEK_SET)
        owner = json.loads(os.read(fd, 4096).decode() or "{}")
        return f"pid {int(owner['pid'])} on {str(owner['host'])[:64]}"
    except (ValueError, KeyError, TypeError, OSError):
        return "another process"


def sibling_lock(folder: Path, what: str) -> FolderLock:
    """The lock of a folder that is replaced whole (so the lock cannot live inside it): .NAME.lock beside it."""
    folder = Path(folder)
    return FolderLock(folder.parent / f".{folder.name}.lock", what)


# ----------------------------------------------------------------------------------------------------------------
# Folders written whole or not at all

_STAGE_SUFFIX = ".staging"


def write_folder(folder: Path, files: dict[str, tuple[str, int]], *, force: bool = False) -> list[Path]:
    """Write `files` (name -> (text, mode)) as the folder's new content, all at once.

    Under the folder's lock: refuse existing targets without force; write everything into a sibling staging
    folder (with whatever else the folder already holds, hard-linked), then swap it into place with one rename
    (renameat2 RENAME_EXCHANGE where the kernel has it, so the old folder is whole until the swap). A crash or a
    signal before the swap leaves the old folder untouched; the staging folder is removed on every way out, and a
    staging folder a killed writer left behind is removed by the next writer.
    """
    folder = Path(folder).absolute()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file; give a folder")
    check_folder_path(folder, "folder")
    targets = [folder / name for name in files]
    refuse_overwrite(targets, force)
    try:
        _write_folder_locked(folder, files, targets, force)
    except OSError as exc:  # a full disk, a folder we may not replace: one line, and nothing left behind
        raise UserError(os_error_line(exc, f"write {folder}")) from None
    return targets


def _write_folder_locked(folder: Path, files: dict[str, tuple[str, int]], targets: list[Path], force: bool) -> None:
    folder_mode = folder.stat().st_mode & 0o7777 if folder.is_dir() else _new_folder_mode()
    existing = next(p for p in folder.parents if p.exists())  # what a failure must leave as the deepest folder

    def remove_created() -> None:
        if not folder.exists():
            remove_created_folders(folder.parent, existing)

    try:
        with undone_if_interrupted(remove_created):
            _write_under_lock(folder, files, targets, force, folder_mode)
    except BaseException:
        remove_created()
        raise


def _new_folder_mode() -> int:
    """The mode mkdir would give a new folder (0o777 less the umask): the staging folder renamed into place must
    not keep mkdtemp's 0o700."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _write_under_lock(folder: Path, files: dict[str, tuple[str, int]], targets: list[Path], force: bool,
                      folder_mode: int) -> None:
    import shutil

    with sibling_lock(folder, f"folder {folder}"):
        refuse_overwrite(targets, force)  # again under the lock: another writer may have finished meanwhile
        for left in folder.parent.glob(f".{folder.name}.*{_STAGE_SUFFIX}"):
            shutil.rmtree(left, ignore_errors=True)  # only a dead writer's: the lock says no one else writes
        if folder.is_dir():
            _refuse_unmovable(folder)
        stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=_STAGE_SUFFIX, dir=folder.parent))
        swapped = False
        try:
            with undone_if_interrupted(lambda: _remove_tree(stage)):
                if folder.is_dir():
                    for entry in folder.iterdir():
                        if entry.name not in files:
                            _link_tree(entry, stage / entry.name)
                for name, (text, mode) in files.items():
                    with open(stage / name, "w") as f:
                        f.write(text)
                        f.flush()
                        os.fsync(f.fileno())
                    os.chmod(stage / name, mode)
                os.chmod(stage, folder_mode)  # mkdtemp makes it 0o700; an existing folder keeps its own mode
                if folder.is_dir():
                    _exchange(stage, folder)  # stage now holds the old content
                else:
                    os.rename(stage, folder)
                swapped = True
        finally:
            _remove_tree(stage)
        if swapped and os.path.lexists(stage):
            raise UserError(f"wrote {folder}, but its previous content, moved to {stage}, could not be removed "
                            "whole; remove that folder by hand")


_FS_IOC_GETFLAGS = 0x80086601
"""<linux/fs.h> _IOR('f', 1, long): a file's inode flags (what lsattr shows)."""
_IMMUTABLE_OR_APPEND_ONLY = 0x10 | 0x20
"""FS_IMMUTABLE_FL | FS_APPEND_FL (chattr +i / +a): such an entry can be neither removed nor renamed away."""


def _refuse_unmovable(folder: Path) -> None:
    """The swap moves the folder's old entries into the staging folder and removes it: an immutable or append-only
    entry (chattr +i / +a) cannot be removed, so the write would leave a staging folder it cannot clean. Refused
    before anything is written."""
    for root, dirs, names in os.walk(folder):
        for name in [*dirs, *names]:
            path = os.path.join(root, name)
            if _inode_flags(path) & _IMMUTABLE_OR_APPEND_ONLY:
                raise UserError(f"{path} is immutable or append-only (chattr +i / +a), so {folder} cannot be "
                                "replaced whole; remove the attribute (chattr -i / -a) or choose another folder")


def _inode_flags(path: str) -> int:
    """lsattr's flags of a regular file or folder; 0 where the file system has none (tmpfs) or it is neither."""
    import fcntl
    import stat
    import struct

    try:
        mode = os.lstat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return 0
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        return struct.unpack("l", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("l", 0)))[0]
    except OSError:
        return 0
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    """rmtree that also removes folders whose mode forbids it (a staging copy of a read-only folder): only folders
    inside `path` are made writable, never `path`'s parent or anything outside it."""
    import shutil

    root = os.path.abspath(path)

    def writable_and_retry(function, name, exc_info):
        parent = os.path.dirname(os.path.abspath(name))
        if parent != root and not parent.startswith(root + os.sep):
            return
        try:
            os.chmod(parent, 0o700)
            function(name)
        except OSError:
            pass

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=writable_and_retry)


def remove_created_folders(folder: Path, keep: Path) -> None:
    """Remove the empty folders a failed write created, from `folder` up to (not including) `keep`, the deepest
    folder that existed before."""
    while folder != keep and keep in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link a file or a folder tree (copy where links cannot be made): no bytes are duplicated."""
    import shutil

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    elif src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        link(src, dst)


def _exchange(a: Path, b: Path) -> None:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); elsewhere, two renames with the old folder
    kept under a temporary name until the new one is in place."""
    import ctypes
    import ctypes.util

    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        renameat2 = getattr(libc, "renameat2", None)
        if renameat2 is not None:
            at_fdcwd, rename_exchange = -100, 2  # <fcntl.h> AT_FDCWD, <linux/fs.h> RENAME_EXCHANGE
            if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
                return
    old = a.with_name(a.name + ".old")
    os.rename(b, old)
    try:
        os.rename(a, b)
    except BaseException:
        os.rename(old, b)
        raise
    os.rename(old, a)
