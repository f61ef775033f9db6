"""Checks that every relative link in the repository's Markdown files resolves (ctest:
host.docs.links).

    python3 tests/check_doc_links.py [ROOT]       # ROOT: the source tree (default: this one's)

For each *.md file under ROOT (build trees, hidden directories and caches left out), every
inline link or image `[text](target)` and every reference definition `[name]: target` whose
target is not a URL (http:, https:, mailto:) must name a file or directory that exists,
relative to the file; a `#fragment` must name a heading of the target Markdown file (or of the
file itself), spelled as GitHub spells heading anchors. Links inside code (fenced blocks and
`spans`) are not links and are skipped. Prints each broken link as FILE:LINE: TARGET: why,
then a summary; exit status 0 when all resolve, 1 when any does not, 2 for a bad ROOT.
"""
import os
import re
import sys

SKIPPED_DIRS = {"__pycache__", "node_modules"}
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
FENCE = re.compile(r"^\s{0,3}(```+|~~~+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files(root):
    """Every *.md under root, sorted, skipping build trees (a CMakeCache.txt or a name starting
    with "build"), hidden directories and caches."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs
                            if not d.startswith(".") and not d.startswith("build")
                            and d not in SKIPPED_DIRS
                            and not os.path.exists(os.path.join(directory, d, "CMakeCache.txt")))
        found.extend(os.path.join(directory, f) for f in sorted(files) if f.endswith(".md"))
    return found


def prose_lines(text):
    """(line number, line) for the lines outside fenced code blocks, with code spans blanked."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)[0] * 3
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        lines.append((number, re.sub(r"(`+).*?\1", lambda m: " " * len(m.group(0)), line)))
    return lines


def heading_anchor(heading):
    """The anchor GitHub gives a heading: its text as rendered (links, code and emphasis
    marks removed), lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path, cache):
    """The set of heading anchors of a Markdown file (duplicates numbered as GitHub does)."""
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        seen, result, fence = {}, set(), None
        for line in text.splitlines():
            opening = FENCE.match(line)
            if fence is None and opening:
                fence = opening.group(1)[0] * 3
                continue
            if fence is not None:
                if line.strip().startswith(fence):
                    fence = None
                continue
            match = HEADING.match(line)
            if match:
                base = heading_anchor(match.group(2))
                count = seen.get(base, 0)
                seen[base] = count + 1
                result.add(base if count == 0 else "%s-%d" % (base, count))
        cache[path] = result
    return cache[path]


def check_target(source, target, cache):
    """None when `target` (as written in `source`) resolves, else why it does not."""
    path, _, fragment = target.partition("#")
    resolved = source if not path else os.path.normpath(
        os.path.join(os.path.dirname(source), path))
    if not os.path.exists(resolved):
        return "no such file or directory"
    if fragment:
        if not resolved.endswith(".md") or os.path.isdir(resolved):
            return None  # anchors into other files (code, SVG) are not checked
        if fragment not in anchors(resolved, cache):
            return "no heading with the anchor #%s in %s" % (fragment, os.path.basename(resolved))
    return None


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    if not os.path.isdir(root):
        print("check_doc_links.py: %s is not a directory" % root, file=sys.stderr)
        return 2
    files = markdown_files(root)
    cache, broken, checked = {}, 0, 0
    for source in files:
        with open(source, encoding="utf-8") as f:
            text = f.read()
        for number, line in prose_lines(text):
            targets = INLINE_LINK.findall(line)
            reference = REFERENCE.match(line)
            if reference:
                targets.append(reference.group(1))
            for target in targets:
                if not target or URL.match(target):
                    continue
                checked += 1
                why = check_target(source, target, cache)
                if why:
                    broken += 1
                    print("%s:%d: %s: %s" % (os.path.relpath(source, root), number, target, why))
    print("%d relative links in %d Markdown files: %s"
          % (checked, len(files), "all resolve" if not broken else "%d broken" % broken))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
