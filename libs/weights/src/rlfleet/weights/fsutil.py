"""Filesystem helpers: atomic publication of a directory, and path confinement."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlfleet.weights.errors import PathOutsideStore


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def publish_dir(tmp: Path, final: Path) -> None:
    """Make ``tmp`` visible as ``final`` in one step: its files are already
    fsynced; fsync the directory, rename (atomic on POSIX; fails if ``final``
    exists, since a non-empty directory is never replaced), fsync the parent
    so the rename itself survives a crash."""
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def confine(path: Path, root: Path) -> Path:
    """Resolve ``path`` (symlinks and ``..`` included) and require it inside ``root``."""
    resolved = path.resolve()
    root = root.resolve()
    if resolved != root and not resolved.is_relative_to(root):
        raise PathOutsideStore(str(path), str(root))
    return resolved


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """A temporary sibling directory to fill; on success it is published as
    ``final`` (``FileExistsError`` if that exists), on any error removed.
    A writer killed meanwhile leaves only the ``.tmp-*`` directory behind."""
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            raise FileExistsError(final)
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
