"""BENCHMARKS.md's "Current figures" invent nothing: every table row there is a row of the dated
section it links to, and every link points at a heading that exists (GitHub's anchor for it)."""
import re
from pathlib import Path

TEXT = (Path(__file__).resolve().parent.parent / "BENCHMARKS.md").read_text()
LINK = re.compile(r"\[([^\]]+)\]\(#([^)]+)\)")


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def front_and_history() -> tuple[str, str]:
    start = TEXT.index("\n## Current figures\n")
    end = TEXT.index("\n## ", start + 1)
    return TEXT[start:end], TEXT[end:]


def headings(text: str) -> list[tuple[int, int, str]]:
    """(line index, level, title) of each markdown heading, outside fenced code blocks (whose
    ``# comments`` are not headings)."""
    found, fenced = [], False
    for i, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(#+) (.+)$", line)):
            found.append((i, len(m.group(1)), m.group(2)))
    return found


def section(history: str, heading: str) -> str:
    """From ``heading`` to the next heading of its level or above."""
    lines, marks = history.splitlines(), headings(history)
    at = [k for k, (_, _, title) in enumerate(marks) if title == heading]
    assert at, f"no heading {heading!r} in BENCHMARKS.md"
    start, level, _ = marks[at[0]]
    end = next((i for i, lv, _ in marks[at[0] + 1:] if lv <= level), len(lines))
    return "\n".join(lines[start + 1:end])


def test_every_current_figure_is_copied_from_the_section_it_points_to():
    front, history = front_and_history()
    parts = re.split(r"^### ", front, flags=re.M)[1:]
    assert len(parts) >= 5, "one table per op: GEMM, AG+GEMM, GEMM+RS, MoE/attention, the simulator"
    for part in parts:
        title = part.splitlines()[0]
        links = LINK.findall(part)
        assert links, f"'{title}' does not point at its full section"
        for text, anchor in links:
            assert anchor == github_anchor(text), f"{text!r}: its anchor is #{github_anchor(text)}"
        source = section(history, links[0][0])
        rows = [line for line in part.splitlines() if line.startswith("|")]
        for row in rows:
            assert row in source.splitlines(), f"'{title}': row not in its section: {row}"
        date = re.search(r"\d{4}-\d{2}-\d{2}", title).group(0)
        enclosing = [t for _, lv, t in headings(history) if lv == 2 and source in section(history, t)]
        assert any(date in h for h in enclosing + [links[0][0]]), f"'{title}': not the date of its section"


def test_the_front_section_comes_first():
    assert TEXT.index("\n## Current figures\n") < TEXT.index("\n## 2026-")
