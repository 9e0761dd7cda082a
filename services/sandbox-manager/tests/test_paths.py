"""Host-side workspace file access never follows what the sandbox planted."""

from __future__ import annotations

import os
import threading

import pytest

from rlfleet.sandbox import InvalidSandboxRequest
from rlfleet.sandbox.paths import is_dir, list_dir, read_file, split_relpath, write_file

OWNER = (os.getuid(), os.getgid())


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    return root


@pytest.mark.parametrize(
    ("path", "parts"),
    [("a", ("a",)), ("a/b/c.txt", ("a", "b", "c.txt")), ("./a//b/", ("a", "b")), ("...", ("...",))],
)
def test_relative_paths_are_split_into_components(path, parts):
    assert split_relpath(path) == parts


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../b", "a/..", "", ".", "a\0b", "x" * 256, 3])
def test_absolute_parent_empty_and_odd_paths_are_refused(path):
    with pytest.raises(InvalidSandboxRequest):
        split_relpath(path)


def test_the_workspace_root_is_allowed_where_asked():
    assert split_relpath(".", allow_root=True) == ()


def test_writes_create_parents_and_read_back(ws):
    write_file(str(ws), "a/b/c.txt", b"hello", owner=OWNER)
    write_file(str(ws), "a/b/c.txt", b"hi", owner=OWNER)  # truncates on rewrite
    assert read_file(str(ws), "a/b/c.txt", max_bytes=10) == b"hi"
    assert [f.path for f in list_dir(str(ws), ".", recursive=True, max_entries=10)] == [
        "a",
        "a/b",
        "a/b/c.txt",
    ]


def test_a_symlink_anywhere_on_the_path_is_refused_and_its_target_untouched(ws, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_text("original")
    os.symlink(outside, ws / "dirlink")
    os.symlink(outside / "target", ws / "filelink")
    (ws / "d").mkdir()
    os.symlink("..", ws / "d" / "up")
    for path in ("dirlink/target", "filelink", "d/up/filelink", "dirlink/new"):
        with pytest.raises(InvalidSandboxRequest):
            write_file(str(ws), path, b"owned", owner=OWNER)
        with pytest.raises(InvalidSandboxRequest):
            read_file(str(ws), path, max_bytes=100)
    assert (outside / "target").read_text() == "original"
    assert not (outside / "new").exists()
    with pytest.raises(InvalidSandboxRequest):
        list_dir(str(ws), "dirlink", recursive=True, max_entries=10)
    assert not is_dir(str(ws), "dirlink")


def test_listing_reports_symlinks_without_following_them(ws, tmp_path):
    os.symlink("/", ws / "root")
    entries = list_dir(str(ws), ".", recursive=True, max_entries=10)
    assert [(f.path, f.kind) for f in entries] == [("root", "symlink")]


def test_a_fifo_is_refused_without_blocking_the_driver(ws):
    os.mkfifo(ws / "fifo")
    done = threading.Event()

    def attempt():
        for op in (
            lambda: read_file(str(ws), "fifo", max_bytes=10),
            lambda: write_file(str(ws), "fifo", b"x", owner=OWNER),
        ):
            with pytest.raises(InvalidSandboxRequest):
                op()
        done.set()

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(5)
    assert done.is_set(), "opening a FIFO blocked"


def test_a_hard_linked_file_is_refused(ws):
    (ws / "a").write_text("x")
    os.link(ws / "a", ws / "b")
    with pytest.raises(InvalidSandboxRequest) as e:
        write_file(str(ws), "b", b"y", owner=OWNER)
    assert e.value.details["reason"] == "hard_link"


def test_reads_over_the_limit_and_listings_over_the_cap_are_refused(ws):
    (ws / "big").write_bytes(b"x" * 100)
    with pytest.raises(InvalidSandboxRequest) as e:
        read_file(str(ws), "big", max_bytes=99)
    assert e.value.details["reason"] == "too_large"
    for i in range(5):
        (ws / f"f{i}").touch()
    with pytest.raises(InvalidSandboxRequest):
        list_dir(str(ws), ".", recursive=False, max_entries=3)


def test_directories_and_missing_files_get_clear_errors(ws):
    (ws / "d").mkdir()
    with pytest.raises(InvalidSandboxRequest, match="is a directory"):
        read_file(str(ws), "d", max_bytes=10)
    with pytest.raises(InvalidSandboxRequest, match="does not exist"):
        read_file(str(ws), "nope/x", max_bytes=10)
