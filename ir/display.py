"""How tldsl's objects show themselves in a REPL and a notebook: a plain ``repr`` of one line
(at most :data:`REPR_LIMIT` characters, whatever the object holds — a cubin, a CUDA source, a
W-rank event log), and a small HTML card for ``_repr_html_``: a heading, a table of facts, and
the long texts (IR, source, timeline) folded away under ``<details>``."""
from __future__ import annotations

import html

#: the longest plain repr any tldsl object returns
REPR_LIMIT = 200


def one_line(text: str, limit: int = REPR_LIMIT) -> str:
    """``text`` on one line (runs of whitespace collapsed) and at most ``limit`` characters: a
    cut keeps an angle-bracketed repr's closing ``>``."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    closing = ">" if text.startswith("<") and text.endswith(">") else ""
    return text[: limit - 1 - len(closing)] + "…" + closing


def html_card(title: str, facts: list[tuple[str, object]], folded: list[tuple[str, str]] = (),
              open_first: bool = False) -> str:
    """A heading, a two-column table of ``facts`` and each ``(summary, text)`` of ``folded`` as a
    ``<details>`` holding the text verbatim (escaped); closed, but for the first one with
    ``open_first`` (an IR, which is what its object is for)."""
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
                   f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>" for k, v in facts)
    parts = [f"<div><strong>{html.escape(title)}</strong>", f"<table>{rows}</table>" if rows else ""]
    for i, (summary, text) in enumerate(folded):
        parts.append(f"<details{' open' if open_first and i == 0 else ''}><summary>{html.escape(summary)}</summary>"
                     f"<pre>{html.escape(text)}</pre></details>")
    parts.append("</div>")
    return "".join(parts)


#: the most lines of a long text (a SASS listing) a card embeds
CARD_LINES = 400


def clipped(text: str, lines: int = CARD_LINES, where: str = "") -> str:
    """``text`` cut to its first ``lines`` lines, saying how many more there are and ``where``
    the whole text is: a notebook keeps what a card holds, so a card holds no megabyte listing."""
    rows = text.splitlines()
    if len(rows) <= lines:
        return text
    return "\n".join(rows[:lines] + [f"… {len(rows) - lines} more lines" + (f" ({where})" if where else "")])


def size(nbytes: int) -> str:
    """``nbytes`` as B / KiB / MiB, for the facts of a card."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def fit(head: str, middles, tail: str, limit: int = REPR_LIMIT) -> str:
    """``head + middle + tail`` in ``limit`` characters: the first of ``middles`` (a string, or
    alternatives from the fullest to the shortest) that fits, else the last one cut — a repr
    whose start and end are what a reader (and a test) looks for."""
    middles = [middles] if isinstance(middles, str) else list(middles)
    room = limit - len(head) - len(tail)
    middle = next((m for m in middles if len(m) <= room), middles[-1])
    if len(middle) > room:
        middle = middle[: max(room - 1, 0)] + "…"
    return one_line(head + middle + tail, limit)


def compact(obj, always: tuple[str, ...] = (), only_always: bool = False) -> str:
    """A dataclass as ``Name(field=value, ...)``: the fields in ``always`` first, then those that
    differ from their defaults (``only_always``: an ellipsis for them) — a schedule in a one-line
    repr, its defining fields before any cut."""
    import dataclasses
    if obj is None:                         # (a kernel without that schedule: a program with no comm part)
        return "None"
    fields = sorted(dataclasses.fields(obj), key=lambda f: always.index(f.name) if f.name in always else len(always))
    changed = [f for f in fields if f.name not in always
               and (f.default is dataclasses.MISSING or getattr(obj, f.name) != f.default)]
    shown = [f"{name}={getattr(obj, name)!r}" for name in always]
    if only_always:
        shown += ["…"] if changed else []
    else:
        shown += [f"{f.name}={getattr(obj, f.name)!r}" for f in changed]
    return f"{type(obj).__name__}({', '.join(shown)})"


def schedules(compute, comm) -> list[str]:
    """A fused op's two schedules for :func:`fit`, from the fullest to the shortest."""
    full = (compact(compute, ("tile",)), compact(comm, ("engine", "mode")))
    short = (compact(compute, ("tile",), only_always=True), compact(comm, ("engine", "mode")))
    shortest = (short[0], compact(comm, ("engine", "mode"), only_always=True))
    return [", ".join(pair) for pair in (full, short, shortest)]
