"""Tests of make_figures.py (ctest: host.plots.checks and host.plots.draw).

    python3 bench/plots/test_make_figures.py checks   # no matplotlib needed
    python3 bench/plots/test_make_figures.py draw     # SKIPPED without matplotlib

checks: the committed data files read well and each says what was measured, on what, when
and how to measure it again; with no data the script names each missing file with the
benchmark and the exact command that makes it, exits 1 and writes nothing; a malformed file
is named with its line; without matplotlib the script says how to install it, exits 1 and
writes nothing.
draw: from the committed data it writes the three SVG files, each well-formed, under 100 KB,
with its title and its caption (date, command) as text, and the same bytes on a second run.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "make_figures.py")
DATA = os.path.join(HERE, "data")
sys.path.insert(0, HERE)
import make_figures  # noqa: E402  (beside this file)

# The benchmark commands the no-data message must give, one per figure.
COMMANDS = {
    "pytorch_fragmentation": "python3 bench/python/run_all.py --only frag --seeds 1",
    "pool_ns_per_op": "./run bench pool --reps 7 --csv bench/plots/data/pool_ns_per_op.csv",
    "workload_limit": "./run bench workload --reps 7",
}
TITLES = {
    "pytorch_fragmentation": "before its first out-of-memory error",
    "pool_ns_per_op": "(bench_pool)",
    "workload_limit": "(bench_workload)",
}


def run(*arguments, python_prelude=None):
    """make_figures.py with `arguments`: (exit status, stdout, stderr). With python_prelude,
    that code runs first in the same interpreter (to hide matplotlib)."""
    if python_prelude:
        command = [sys.executable, "-c", "%s\nimport runpy, sys\nsys.argv = %r\n"
                   "runpy.run_path(%r, run_name='__main__')"
                   % (python_prelude, [SCRIPT] + list(arguments), SCRIPT)]
    else:
        command = [sys.executable, SCRIPT] + list(arguments)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def check(condition, what, output=""):
    if not condition:
        sys.exit("FAILED: %s\n%s" % (what, output))
    print("ok: " + what)


def checks(work):
    # The committed data: read as each figure needs it, and described.
    loaded, errors = make_figures.load_all(DATA)
    check(not errors and len(loaded) == len(make_figures.FIGURES),
          "the committed data files read well", "\n".join(errors))
    for figure, meta, rows in loaded:
        lacking = [k for k in ("measured", "device", "date", "command") if not meta.get(k)]
        check(not lacking and rows, "%s's data says what, on what, when and how (and has rows)"
              % figure["name"], "lacks %s" % lacking)

    # No data at all: each file named, with its benchmark and command; exit 1; nothing written.
    empty, out = os.path.join(work, "empty"), os.path.join(work, "out-empty")
    os.makedirs(empty)
    status, _, err = run("--data", empty, "--out", out)
    check(status == 1, "no data: exit status 1 (got %d)" % status, err)
    for name, command in COMMANDS.items():
        check(os.path.join(empty, name + ".csv") + " is missing" in err and command in err,
              "no data: %s.csv named, with the command `%s`" % (name, command), err)
    check(not os.path.exists(out), "no data: nothing written")

    # A malformed file: the file, the line and the cell; nothing drawn from it.
    bad, out = os.path.join(work, "bad"), os.path.join(work, "out-bad")
    os.makedirs(bad)
    with open(os.path.join(DATA, "pool_ns_per_op.csv"), encoding="utf-8") as f:
        lines = f.read().splitlines(True)
    row = next(i for i, line in enumerate(lines) if line.startswith("pair_1MiB,pool,"))
    lines[row] = "pair_1MiB,pool,fast\n"
    with open(os.path.join(bad, "pool_ns_per_op.csv"), "w", encoding="utf-8") as f:
        f.writelines(lines)
    status, _, err = run("--data", bad, "--out", out)
    expected = ("pool_ns_per_op.csv, line %d: 'fast' in column ns_per_op is not a number"
                % (row + 1))
    check(status == 1 and expected in err, "a bad number: its file, line and cell named", err)
    with open(os.path.join(bad, "pool_ns_per_op.csv"), "w", encoding="utf-8") as f:
        f.write("# date: today\ntrace,allocator\npair_1MiB,pool\n")
    status, _, err = run("--data", bad, "--out", out)
    check(status == 1 and "lacks the column(s) ns_per_op" in err,
          "a missing column: named", err)
    check(not os.path.exists(out), "bad data: nothing written")

    # No matplotlib: one sentence with the install command; exit 1; nothing written.
    out = os.path.join(work, "out-no-matplotlib")
    status, _, err = run("--out", out,
                         python_prelude="import sys; sys.modules['matplotlib'] = None")
    check(status == 1 and "pip install matplotlib" in err,
          "no matplotlib: says `pip install matplotlib`, exit 1", err)
    check(not os.path.exists(out), "no matplotlib: nothing written")


def draw(work):
    if importlib.util.find_spec("matplotlib") is None:
        print("SKIPPED: matplotlib is not installed (pip install matplotlib)")
        return
    outputs = []
    for attempt in (1, 2):
        out = os.path.join(work, "out-%d" % attempt)
        status, printed, err = run("--out", out)
        check(status == 0, "run %d: exit status 0" % attempt, printed + err)
        outputs.append(out)
    for figure, meta, _ in make_figures.load_all(DATA)[0]:
        path = os.path.join(outputs[0], figure["svg"])
        check(os.path.isfile(path), "%s written" % figure["svg"])
        size = os.path.getsize(path)
        check(size < 100_000, "%s is %d bytes (< 100 KB)" % (figure["svg"], size))
        tree = ElementTree.parse(path)  # raises on a malformed file
        # The figure's words, its caption's lines joined as one text.
        words = " ".join(" ".join(element.itertext()) for element in tree.iter()
                         if element.tag.endswith("}text"))
        words = " ".join(words.split())
        for text in (TITLES[figure["name"]], "When: " + meta["date"],
                     "Reproduce: " + meta["command"]):
            check(text in words, "%s holds %r as text" % (figure["svg"], text), words)
        with open(path, "rb") as first:
            with open(os.path.join(outputs[1], figure["svg"]), "rb") as second:
                check(first.read() == second.read(),
                      "%s: the same bytes on a second run" % figure["svg"])


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in ("checks", "draw"):
        sys.exit("usage: test_make_figures.py checks|draw")
    work = tempfile.mkdtemp(prefix="make_figures_test_")
    try:
        (checks if sys.argv[1] == "checks" else draw)(work)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
