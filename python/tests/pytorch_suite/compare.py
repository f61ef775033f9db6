#!/usr/bin/env python3
"""Compares two run_pytorch_tests.py reports: PyTorch's allocator against cudamem's.

    python3 compare.py default.json cudamem.json [--markdown] [--all] [--out FILE]

Groups the tests both reports ran:
  regressions       pass (or xfail) under the first report, not under the second
  improvements      pass under the second only
  failing in both   fail / error / crash / timeout / xpass under both
  passing in both
  skipped           skipped (or not run) under either
and prints each group's tests with the first line of their failure messages (passing in
both: a count, unless --all). Tests marked post-2.11 by the runner (they assert behaviour
PyTorch 2.11's binary does not have) carry "[post-2.11]". --markdown writes tables for
python/README.md. The exit status is 0 whatever the outcome (1 when a report is unreadable).
"""
import argparse
import json
import signal
import sys

PASS = {"pass", "xfail"}
FAIL = {"fail", "error", "crash", "timeout", "xpass"}
SKIP = {"skip", "not_run"}


def load(path):
    with open(path) as f:
        report = json.load(f)
    if "tests" not in report:
        raise ValueError("%s has no 'tests': not a run_pytorch_tests.py report" % path)
    return report


def kind(outcome):
    if outcome in PASS:
        return "pass"
    if outcome in FAIL:
        return "fail"
    return "skip"


def first_line(entry):
    if not entry:
        return ""
    text = (entry.get("message") or "").strip()
    line = text.splitlines()[0] if text else ""
    if entry.get("poisoned_cuda"):
        line += " [CUDA unusable afterwards: %s]" % entry["poisoned_cuda"].splitlines()[0]
    return line[:200]


def classify(a, b):
    groups = {"regressions": [], "improvements": [], "failing in both": [],
              "passing in both": [], "skipped": []}
    for test in sorted(set(a["tests"]) | set(b["tests"])):
        ea, eb = a["tests"].get(test), b["tests"].get(test)
        ka = kind(ea["outcome"]) if ea else "skip"
        kb = kind(eb["outcome"]) if eb else "skip"
        if ka == "skip" or kb == "skip":
            group = "skipped"
        elif ka == "pass" and kb == "pass":
            group = "passing in both"
        elif ka == "pass":
            group = "regressions"
        elif kb == "pass":
            group = "improvements"
        else:
            group = "failing in both"
        groups[group].append((test, ea, eb))
    return groups


def outcome(entry):
    return entry["outcome"] if entry else "absent"


def tag(test, post):
    return " [post-2.11]" if test in post else ""


def render_text(a, b, groups, post, show_all):
    na, nb = a.get("allocator", "first"), b.get("allocator", "second")
    lines = []
    lines.append("%s (%s) vs %s (%s)" % (na, a.get("environment", {}).get("allocator_backend",
                                                                          "?"),
                                         nb, b.get("environment", {}).get("allocator_backend",
                                                                          "?")))
    env = b.get("environment") or a.get("environment") or {}
    lines.append("torch %s (%s), %s; test file sha256 %s%s" % (
        env.get("torch"), (env.get("torch_git") or "")[:12], env.get("device"),
        (a.get("test_file_sha256") or "")[:12],
        "" if a.get("test_file_sha256") == b.get("test_file_sha256")
        else " / %s (DIFFERENT FILES)" % (b.get("test_file_sha256") or "")[:12]))
    if b.get("environment", {}).get("cudamem_mode") == "pluggable":
        lines.append("WARNING: cudamem ran through the pluggable-allocator fallback "
                     "(no C++ compiler?): statistics, snapshots and graphs are unavailable")
    lines.append("")
    for name, members in groups.items():
        lines.append("%-16s %4d" % (name, len(members)))
    lines.append("")
    for name, members in groups.items():
        if not members or (name == "passing in both" and not show_all):
            continue
        lines.append("== %s (%d)" % (name, len(members)))
        for test, ea, eb in members:
            lines.append("  %s%s: %s %s / %s %s" % (test, tag(test, post), na, outcome(ea),
                                                    nb, outcome(eb)))
            if name == "regressions":
                lines.append("      %s: %s" % (nb, first_line(eb)))
            elif name == "improvements":
                lines.append("      %s: %s" % (na, first_line(ea)))
            elif name == "failing in both":
                la, lb = first_line(ea), first_line(eb)
                if la == lb:
                    lines.append("      both: %s" % la)
                else:
                    lines.append("      %s: %s" % (na, la))
                    lines.append("      %s: %s" % (nb, lb))
            elif name == "skipped":
                reason = first_line(eb if eb and kind(eb["outcome"]) == "skip" else ea)
                if reason:
                    lines.append("      %s" % reason)
        lines.append("")
    return "\n".join(lines)


def md(text):
    return (text or "").replace("|", "\\|").replace("\n", " ")


def render_markdown(a, b, groups, post, show_all):
    na, nb = a.get("allocator", "first"), b.get("allocator", "second")
    env = b.get("environment") or a.get("environment") or {}
    out = []
    out.append("PyTorch's `test_cuda.py` (sha256 `%s`), torch %s on %s: %s against %s." % (
        (a.get("test_file_sha256") or "")[:12], env.get("torch"), env.get("device"), na, nb))
    out.append("")
    out.append("| group | tests |")
    out.append("|---|---:|")
    for name, members in groups.items():
        out.append("| %s | %d |" % (name, len(members)))
    out.append("")
    for name, members in groups.items():
        if not members or (name == "passing in both" and not show_all):
            continue
        out.append("**%s** (%d)" % (name.capitalize(), len(members)))
        out.append("")
        out.append("| test | %s | %s | first line of the failure |" % (na, nb))
        out.append("|---|---|---|---|")
        for test, ea, eb in members:
            if name == "improvements":
                why = first_line(ea)
            elif name == "skipped":
                why = first_line(eb if eb and kind(eb["outcome"]) == "skip" else ea)
            elif name == "failing in both":
                la, lb = first_line(ea), first_line(eb)
                why = la if la == lb else "%s: %s; %s: %s" % (na, la, nb, lb)
            else:
                why = first_line(eb)
            out.append("| `%s`%s | %s | %s | %s |" % (test, tag(test, post), outcome(ea),
                                                    outcome(eb), md(why)))
        out.append("")
    if post:
        out.append("[post-2.11]: the shipped test file is PyTorch main of early March 2026; "
                   "these tests assert behaviour the 2.11 binary does not have.")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Compare two run_pytorch_tests.py reports (e.g. default.json against "
                    "cudamem.json): regressions, improvements, failing in both, passing in "
                    "both, skipped.")
    parser.add_argument("first", help="report of the reference run (--allocator default)")
    parser.add_argument("second", help="report of the run to judge (--allocator cudamem)")
    parser.add_argument("--markdown", action="store_true", help="Markdown tables")
    parser.add_argument("--all", action="store_true",
                        help="also list the tests passing in both")
    parser.add_argument("--out", help="write here instead of stdout")
    args = parser.parse_args(argv)
    try:
        a, b = load(args.first), load(args.second)
    except (OSError, ValueError) as e:
        print("compare.py: %s" % e, file=sys.stderr)
        return 1
    post = dict(a.get("post_2_11_tests") or {})
    post.update(b.get("post_2_11_tests") or {})
    groups = classify(a, b)
    render = render_markdown if args.markdown else render_text
    text = render(a, b, groups, post, args.all)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        if hasattr(signal, "SIGPIPE"):
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `compare.py ... | head`
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
