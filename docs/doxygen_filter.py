#!/usr/bin/env python3
"""Doxygen's input filter for cudamem's headers (docs/Doxyfile: FILTER_PATTERNS).

Each public header opens with a plain `//` block: a one-line summary naming the file, a usage
example, the contract. Read as text, the header needs nothing more; for the reference, this
filter hands Doxygen that block as the header's documentation:

    // cudamem/event.hpp — an owning CUDA event ...       /** an owning CUDA event ...
    //                                                      * @code{.cpp}
    //   cudamem::event e;                          ->      * cudamem::event e;
    //                                                      * @endcode
    // Contract                                             * <b>Contract</b>
    // - `record(s)` ...                                    * - `record(s)` ...
    //   continued                                          *   continued @file */

- Lines indented by three spaces or more after `//` that follow an empty `//` line (or another
  such line) are code: they become a @code block. Indented lines that follow text are the
  continuation of a list item, as in Markdown.
- Lines indented under a line of text by two spaces or more (a list of parts, the verdicts in
  memory_report.hpp), and lists laid out in columns, are kept as they are laid out (@verbatim).
- A line of text on its own, with no full stop, followed by a list or such a table
  ("Contract", "Contract (memory_resource.hpp's, plus)", "Parts (...)") is a heading: bold.
- Outside `backticks` and "quotes", the characters Doxygen would read as commands or HTML
  (\\ @ < > & # %) are escaped, and __host__-style names are set as code, so the text shows
  as written.
- Every line stays on its line (the source view and Doxygen's messages keep their line numbers)
  and everything after the block is passed through unchanged. @file goes at the end of the
  block: on its first line, Doxygen 1.9.4 misreads `a::b::c` in the summary as a link.

Headers whose first line does not name a public header (the parts under detail/) are passed
through unchanged: their public types are documented where they are declared.

    python3 docs/doxygen_filter.py include/cudamem/event.hpp
"""

import re
import sys

FIRST_LINE = re.compile(r"^// cudamem/[^/ ]+\.hpp — (.*)$")
SPECIAL = re.compile(r"([\\@<>&#%])")
LIST_ITEM = re.compile(r"^\s*[-*] ")
DUNDER = re.compile(r"(?<![`\w])(__\w+__)(?![`\w])")


class Escaper:
    """Escapes Doxygen's special characters outside `code spans` and "quotes" (Doxygen shows
    quoted text as it is, backslashes included). A quote may run over several lines."""

    def __init__(self):
        self.in_quote = False

    def __call__(self, text):
        text = DUNDER.sub(r"`\1`", text)  # __host__ is code, not Markdown's bold "host"
        parts = text.split("`")
        for i in range(0, len(parts), 2):  # even parts are outside backticks
            parts[i] = self.escape_outside_quotes(parts[i])
        if len(parts) % 2 == 0:  # an unmatched backtick: the rest is text too
            parts[-1] = self.escape_outside_quotes(parts[-1])
        return "`".join(parts)

    def escape_outside_quotes(self, text):
        pieces = text.split('"')
        for i, piece in enumerate(pieces):
            if i > 0:
                self.in_quote = not self.in_quote
            if not self.in_quote:
                pieces[i] = SPECIAL.sub(r"\\\1", piece)
        return '"'.join(pieces)


def indent_of(body):
    return len(body) - len(body.lstrip())


def content_indent(body):
    """Where a line's text starts: after the marker of a list item ("- ", "* ")."""
    item = LIST_ITEM.match(body)
    return item.end() if item else indent_of(body)


def introduces_rows(body):
    """A line ending with ':', or a title of its own ("Parts (...)"): what follows it indented
    is a table. (Anything else continues onto its indented lines.)"""
    text = body.rstrip()
    return text.endswith(":") or (indent_of(body) == 1 and not LIST_ITEM.match(body) and
                                  not text.endswith((".", ",", ";")))


def classify(bodies):
    """'blank', 'code', 'table' or 'text' for each line's body (what follows its `//`)."""
    kinds = []
    while len(kinds) < len(bodies):
        i = len(kinds)
        body = bodies[i]
        following = bodies[i + 1] if i + 1 < len(bodies) else ""
        if body.strip() == "":
            kinds.append("blank")
        elif body.startswith("   ") and kinds and kinds[-1] in ("blank", "code"):
            kinds.append("code")  # indented after an empty line: an example
        elif (LIST_ITEM.match(body) and following.strip() and
              indent_of(following) >= content_indent(body) + 4):
            # A list laid out in columns ("- detail/x.hpp   what it owns"): kept as it is, with
            # the items after it and their continuations.
            deep = content_indent(body) + 4
            while (len(kinds) < len(bodies) and bodies[len(kinds)].strip() and
                   (LIST_ITEM.match(bodies[len(kinds)]) or indent_of(bodies[len(kinds)]) >= deep)):
                kinds.append("table")
        elif (kinds and kinds[-1] == "text" and introduces_rows(bodies[i - 1]) and
              indent_of(body) >= content_indent(bodies[i - 1]) + 2):
            # Rows indented under the line that announces them (a list of parts, the verdicts):
            # kept as laid out.
            rows = indent_of(body)
            while (len(kinds) < len(bodies) and bodies[len(kinds)].strip() and
                   indent_of(bodies[len(kinds)]) >= rows):
                kinds.append("table")
        else:
            kinds.append("text")  # including a list item's indented continuation
    return kinds


def is_heading(body, following_kind, following):
    """A short line of its own, no full stop, introducing a list or a table: "Contract",
    "Design: ...", "Parts (...)"."""
    return (body.startswith(" ") and not body.startswith("  ") and not LIST_ITEM.match(body) and
            not body.rstrip().endswith((".", ":")) and
            (following.startswith(" - ") or following_kind == "table"))


def convert_block(block):
    """The header's opening `//` lines (without their newlines) as a Doxygen comment."""
    bodies = [line[2:] for line in block]
    kinds = classify(bodies)
    summary = FIRST_LINE.match(block[0]).group(1)
    escape_text = Escaper()
    out = ["/** " + escape_text(summary)]
    for i in range(1, len(bodies)):
        body, kind = bodies[i], kinds[i]
        before = kinds[i - 1]
        after = kinds[i + 1] if i + 1 < len(kinds) else "end"
        following = bodies[i + 1] if i + 1 < len(bodies) else ""
        if kind == "code":
            line = body[3:] + (" @endcode" if after not in ("code", "blank") else "")
        elif kind == "table":
            line = body[1:] + (" @endverbatim" if after != "table" else "")
        elif kind == "blank":
            line = ""  # between two code lines: an empty line of the example
            if before != "code" and after == "code":
                line = "@code{.cpp}"
            elif before == "code" and after != "code":
                line = "@endcode"
        elif is_heading(body, after, following):
            line = "<b>" + escape_text(body.strip()) + "</b>"
        else:
            line = escape_text(body[1:] if body.startswith(" ") else body)
        if kind != "table" and after == "table":
            line += " @verbatim"
        # Doxygen strips a comment line's leading "*"s: the " * " in front keeps the text's own
        # (*emphasis*, a * list). Verbatim lines are taken as they are, so they go bare.
        out.append((line if kind == "table" else " * " + line).rstrip())
    out[-1] += " @file */"
    # A "*/" in the text would end the comment early.
    return [line[:3] + line[3:].replace("*/", "* /") for line in out[:-1]] + out[-1:]


def main():
    with open(sys.argv[1], encoding="utf-8") as header:
        lines = header.read().split("\n")
    if not lines or not FIRST_LINE.match(lines[0]):
        sys.stdout.write("\n".join(lines))
        return
    end = 0
    while end < len(lines) and lines[end].startswith("//"):
        end += 1
    sys.stdout.write("\n".join(convert_block(lines[:end]) + lines[end:]))


if __name__ == "__main__":
    main()
