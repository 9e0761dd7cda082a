"""Workspace file access from the host side, safe against whatever the sandbox left in the workspace.

The driver runs as root and the workspace is written by untrusted code, so a path is never resolved
by the kernel in one go (a planted symlink `out -> /etc` would make root write to the host). Instead
every component is opened relative to its parent's fd with O_NOFOLLOW: a symlink anywhere on the
path is refused, ".." and absolute paths are refused before any syscall, and containment holds by
construction rather than by a realpath check that could race with the sandbox. Non-regular files
(FIFOs that would block the driver, sockets) are refused too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from rlfleet.sandbox.driver import FileInfo
from rlfleet.sandbox.errors import InvalidSandboxRequest

MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_relpath(path: str, *, field: str = "path", allow_root: bool = False) -> tuple[str, ...]:
    """Validate a workspace-relative path and return its components ("." gives () if allowed)."""
    if not isinstance(path, str):
        raise InvalidSandboxRequest(f"{field} must be a str, got {type(path).__name__}", field=field)
    if "\0" in path:
        raise InvalidSandboxRequest(f"{field} {path!r} contains a NUL byte", field=field, path=path)
    if path.startswith("/"):
        raise InvalidSandboxRequest(
            f"{field} {path!r} is absolute; paths are relative to the workspace", field=field, path=path
        )
    if len(path.encode()) > MAX_PATH_BYTES:
        raise InvalidSandboxRequest(f"{field} is longer than {MAX_PATH_BYTES} bytes", field=field, path=path)
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise InvalidSandboxRequest(f"{field} {path!r} contains '..'", field=field, path=path)
    if any(len(p.encode()) > MAX_NAME_BYTES for p in parts):
        raise InvalidSandboxRequest(
            f"{field} {path!r} has a component over {MAX_NAME_BYTES} bytes", field=field
        )
    if not parts and not allow_root:
        raise InvalidSandboxRequest(f"{field} {path!r} names the workspace itself, not a file", field=field)
    return parts


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _refuse(path: str, why: str, reason: str) -> InvalidSandboxRequest:
    return InvalidSandboxRequest(f"path {path!r} {why}", field="path", path=path, reason=reason)


def _open_dir(parent: int, name: str, path: str, *, create: bool, owner: tuple[int, int] | None) -> int:
    created = False
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
            created = True
        except FileExistsError:
            pass  # already there (or just made by the sandbox): the open below checks what it is
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise _refuse(path, "does not exist", "not_found") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(
                path, f"goes through {name!r}, which is a symlink or not a directory", "not_a_directory"
            ) from None
        raise
    if created and owner is not None:
        os.fchown(fd, *owner)
    return fd


def open_dir(
    root: str, parts: tuple[str, ...], *, create: bool = False, owner: tuple[int, int] | None = None
) -> int:
    """An fd of workspace dir `parts`, opened component by component without following symlinks."""
    fd = os.open(root, _DIR_FLAGS)
    walked: list[str] = []
    try:
        for name in parts:
            walked.append(name)
            nxt = _open_dir(fd, name, "/".join(walked), create=create, owner=owner)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_regular(parent: int, name: str, path: str, flags: int) -> int:
    # O_NONBLOCK so that a FIFO the sandbox planted cannot block the driver; it is refused below.
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644, dir_fd=parent)
    except FileNotFoundError:
        raise _refuse(path, "does not exist", "not_found") from None
    except IsADirectoryError:
        raise _refuse(path, "is a directory", "is_a_directory") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise _refuse(
                path, "is a symlink or special file; it is not followed", "not_a_regular_file"
            ) from None
        raise
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise _refuse(path, "is a directory", "is_a_directory")
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, "is not a regular file", "not_a_regular_file")
    if st.st_nlink > 1:
        # A hard link could alias a file we did not mean to touch; workspaces never need them.
        os.close(fd)
        raise _refuse(path, "is a hard link shared with another path", "hard_link")
    os.set_blocking(fd, True)
    return fd


def write_file(root: str, path: str, data: bytes, *, owner: tuple[int, int]) -> None:
    parts = split_relpath(path)
    with _fd(open_dir(root, parts[:-1], create=True, owner=owner)) as parent:
        with _fd(_open_regular(parent, parts[-1], path, os.O_WRONLY | os.O_CREAT)) as fd:
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchown(fd, *owner)


def read_file(root: str, path: str, *, max_bytes: int) -> bytes:
    parts = split_relpath(path)
    with _fd(open_dir(root, parts[:-1])) as parent:
        with _fd(_open_regular(parent, parts[-1], path, os.O_RDONLY)) as fd:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise InvalidSandboxRequest(
                    f"path {path!r} is {size} bytes, over the {max_bytes}-byte read limit",
                    field="path",
                    path=path,
                    reason="too_large",
                )
            chunks, total = [], 0
            while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - total)):
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:  # grew while we read it
                    raise _refuse(path, f"grew past the {max_bytes}-byte read limit", "too_large")
            return b"".join(chunks)


def list_dir(root: str, path: str, *, recursive: bool, max_entries: int) -> list[FileInfo]:
    parts = split_relpath(path, allow_root=True)
    out: list[FileInfo] = []
    prefix = "/".join(parts)
    with _fd(open_dir(root, parts)) as fd:
        _scan(fd, prefix, recursive, out, max_entries)
    return sorted(out, key=lambda f: f.path)


def _scan(dir_fd: int, prefix: str, recursive: bool, out: list[FileInfo], max_entries: int) -> None:
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            rel = f"{prefix}/{entry.name}" if prefix else entry.name
            out.append(FileInfo(rel, _kind(st.st_mode), st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime))
            if len(out) > max_entries:
                raise InvalidSandboxRequest(
                    f"more than {max_entries} entries; list a subdirectory or non-recursively",
                    field="path",
                    path=prefix or ".",
                    reason="too_many_entries",
                )
            if recursive and stat.S_ISDIR(st.st_mode):
                try:
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
                except OSError:
                    continue  # replaced by the sandbox since scandir saw it; its own entry is listed
                with _fd(child):
                    _scan(child, rel, recursive, out, max_entries)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def is_dir(root: str, path: str) -> bool:
    parts = split_relpath(path, field="cwd", allow_root=True)
    try:
        os.close(open_dir(root, parts))
    except InvalidSandboxRequest:
        return False
    return True
