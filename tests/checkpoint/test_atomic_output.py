"""Output folders and files appear whole or not at all, and a finished folder is never
replaced unless asked: the rename primitive, on its own and under concurrency."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from kvcalib import writes
from kvcalib.errors import UsageError
from kvcalib.writes import atomic_output_dir, atomic_output_file, rename_noreplace


@pytest.fixture(params=["renameat2", "mkdir fallback"])
def implementation(request, monkeypatch) -> str:
    """Run each test with Linux's renameat2 and with the portable fallback."""
    if request.param == "renameat2":
        assert writes._renameat2 is not None  # this project runs on Linux with glibc
    else:
        monkeypatch.setattr(writes, "_renameat2", None)
    return request.param


def _folder(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "file.txt").write_text(content)
    return path


def _listing(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


def test_rename_into_a_free_name(implementation, tmp_path):
    src = _folder(tmp_path / "src", "new")
    rename_noreplace(src, tmp_path / "dst")
    assert not src.exists() and _listing(tmp_path / "dst") == {"file.txt": "new"}


@pytest.mark.parametrize("existing", ["full folder", "empty folder", "file"])
def test_rename_never_replaces(existing, implementation, tmp_path):
    src = _folder(tmp_path / "src", "new")
    dst = tmp_path / "dst"
    if existing == "full folder":
        _folder(dst, "old")
    elif existing == "empty folder":
        dst.mkdir()
    else:
        dst.write_text("old")
    before = _listing(tmp_path)
    with pytest.raises(FileExistsError):
        rename_noreplace(src, dst)
    assert _listing(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_concurrent_renames_have_one_winner(implementation, tmp_path):
    sources = [_folder(tmp_path / f"src{i}", str(i)) for i in range(16)]
    outcome: dict[int, str] = {}
    start = threading.Barrier(len(sources))

    def move(i: int) -> None:
        start.wait()
        try:
            rename_noreplace(sources[i], tmp_path / "dst")
            outcome[i] = "moved"
        except FileExistsError:
            outcome[i] = "refused"

    threads = [threading.Thread(target=move, args=(i,)) for i in range(len(sources))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (winner,) = [i for i, what in outcome.items() if what == "moved"]
    assert _listing(tmp_path / "dst") == {"file.txt": str(winner)}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["dst", *(f"src{i}" for i in range(len(sources)) if i != winner)])


def test_output_folder_that_appeared_meanwhile_is_kept(implementation, tmp_path):
    target = tmp_path / "out"
    appeared = pytest.raises(UsageError, match="appeared while this run was working")
    with appeared, atomic_output_dir(target) as tmp:
        (tmp / "report.json").write_text("mine")
        _folder(target, "theirs")  # another run finished first
    assert _listing(tmp_path) == {"out/file.txt": "theirs"}


def test_an_empty_output_folder_is_filled(implementation, tmp_path):
    target = tmp_path / "out"
    target.mkdir()  # made for us, as check_output_target allows
    with atomic_output_dir(target) as tmp:
        (tmp / "report.json").write_text("mine")
    assert _listing(tmp_path) == {"out/report.json": "mine"}


def test_overwrite_replaces_only_once_complete(implementation, tmp_path):
    target = _folder(tmp_path / "out", "old")
    with pytest.raises(KeyboardInterrupt), atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "half.json").write_text("{")
        raise KeyboardInterrupt
    assert _listing(tmp_path) == {"out/file.txt": "old"}
    with atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "report.json").write_text("new")
    assert _listing(tmp_path) == {"out/report.json": "new"}


def test_output_file_is_replaced_whole(tmp_path):
    target = tmp_path / "r.json"
    target.write_text(json.dumps({"old": True}))
    with pytest.raises(KeyboardInterrupt), atomic_output_file(target) as tmp:
        tmp.write_text("{")
        raise KeyboardInterrupt
    assert json.loads(target.read_text()) == {"old": True}
    with atomic_output_file(target) as tmp:
        tmp.write_text(json.dumps({"new": True}))
    assert json.loads(target.read_text()) == {"new": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
