"""ampkit/files.py: new files are published all or none, never over an existing one."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ampkit.files import publish_new, strict_json


def _writers(folder: Path, fail_on: str | None = None) -> dict:
    def write(name: str):  # type: ignore[no-untyped-def]
        def to(tmp: Path) -> None:
            if name == fail_on:
                raise OSError(errno.ENOSPC, "No space left on device")
            tmp.write_text(name)
        return to

    return {folder / name: write(name) for name in ("a.json", "b.png", "c.png")}


def test_all_three_or_none(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="No space left"):
        publish_new(_writers(tmp_path, fail_on="c.png"))
    assert list(tmp_path.iterdir()) == []  # neither the first two nor a temporary file
    publish_new(_writers(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["a.json", "b.png", "c.png"]


@pytest.mark.parametrize("links", ["hard links", "no hard links"])
def test_a_file_that_exists_is_never_overwritten(tmp_path: Path, links: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if links == "no hard links":  # a file system that refuses os.link: checked, then renamed
        monkeypatch.setattr("os.link", lambda *a: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
    (tmp_path / "b.png").write_text("someone else's")
    with pytest.raises(FileExistsError) as clash:
        publish_new(_writers(tmp_path))
    assert (clash.value.filename2 or clash.value.filename).endswith("b.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.png"] and (tmp_path / "b.png").read_text() == "someone else's"


def test_strict_json_lists_what_it_replaced() -> None:
    found: list[str] = []
    assert strict_json({"a": [1.0, float("nan")], "b": {"c": float("inf")}}, "", found) == {"a": [1.0, None],
                                                                                            "b": {"c": None}}
    assert found == ["a[1]: nan", "b.c: inf"]
