"""Atomic, non-clobbering writes: nothing on disk is half-written or silently overwritten."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from toolkit.errors import UserError


def refuse_overwrite(paths: list[Path], force: bool) -> None:
    """Raise before writing anything if any target exists and --force was not given."""
    if force:
        return
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise UserError(f"{existing[0]} already exists ({len(existing)} file(s) would be overwritten); "
                        "pass --force to overwrite or choose another --out")


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write `text` to a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        self._fd = fd
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
    import shutil

    folder = Path(folder).absolute()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file; give a folder")
    targets = [folder / name for name in files]
    refuse_overwrite(targets, force)
    with sibling_lock(folder, f"folder {folder}"):
        refuse_overwrite(targets, force)  # again under the lock: another writer may have finished meanwhile
        for left in folder.parent.glob(f".{folder.name}.*{_STAGE_SUFFIX}"):
            shutil.rmtree(left, ignore_errors=True)  # only a dead writer's: the lock says no one else writes
        stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=_STAGE_SUFFIX, dir=folder.parent))
        try:
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
            os.chmod(stage, 0o755)  # mkdtemp makes it 0o700
            if folder.is_dir():
                _exchange(stage, folder)  # stage now holds the old content
            else:
                os.rename(stage, folder)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return targets


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
