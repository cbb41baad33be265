"""The two session numberings: ours (``number``) and the public archive's (``archive_number``), their
uniqueness, the order of the sessions list, and where the site shows them."""

from __future__ import annotations

from pathlib import Path

from paperclub.content import load
from paperclub.sitegen import session_page, sessions_index
from tests.conftest import make_repo, repository_content

EXAMPLE = "sessions/2026-01-04-example-session"


def add_session(root: Path, folder: str, **fields) -> None:
    lines = [f"{k}: {v}" for k, v in fields.items()]
    (root / "sessions" / folder).mkdir(parents=True)
    (root / "sessions" / folder / "session.yaml").write_text("\n".join(lines) + "\n")


def test_a_number_names_one_session(tmp_path):
    root = make_repo(tmp_path)
    example = root / EXAMPLE / "session.yaml"
    example.write_text("archive_number: 5\n" + example.read_text())
    add_session(
        root, "2026-01-11-other", title='"Other"', date="2026-01-11", date_known="exact", archive_number=5
    )
    _, problems = load(root)
    assert [(p.file, p.field) for p in problems] == [
        ("sessions/2026-01-11-other/session.yaml", "archive_number")
    ]
    assert "5 is already the archive_number of sessions/2026-01-04-example-session" in str(problems[0])


def test_archive_number_must_be_a_positive_whole_number(tmp_path):
    root = make_repo(tmp_path)
    example = root / EXAMPLE / "session.yaml"
    example.write_text("archive_number: 0\n" + example.read_text())
    _, problems = load(root)
    assert [p.field for p in problems] == ["archive_number"]
    assert "session's number in the group's public archive" in problems[0].message


def test_undated_numbered_session_sits_between_its_neighbours(tmp_path):
    root = make_repo(tmp_path)
    add_session(root, "2025-01-05-first", title='"First"', date="2025-01-05", date_known="exact", number=1)
    add_session(root, "undated-second", title='"Second"', date_known="unknown", number=2)
    add_session(root, "undated-unnumbered", title='"Unnumbered"', date_known="unknown")
    add_session(root, "planned-next", title='"Next"', date_known="planned")
    content, problems = load(root)
    assert not problems, problems
    order = [s.folder for s in content.sessions_newest_first()]
    assert order == [
        "planned-next",
        "2026-01-04-example-session",  # number 3
        "undated-second",
        "2025-01-05-first",
        "undated-unnumbered",
    ]


def test_the_site_shows_both_numbers():
    content, problems = repository_content()
    assert not problems
    index = sessions_index(content)
    assert "| Date | Archive | Session |" in index
    megatron = next(s for s in content.sessions if s.meta.archive_number == 8)
    assert "| about 2025-03-11 | 8 | #8 [" in index
    page = session_page(content, megatron)
    assert "#8 (#8 in the group's [public archive]" in page
    # every session of the archive's 1-18 is there, once, in the archive's order along the list
    numbered = [
        s.meta.archive_number for s in reversed(content.sessions_newest_first()) if s.meta.archive_number
    ]
    assert numbered == list(range(1, 19))
