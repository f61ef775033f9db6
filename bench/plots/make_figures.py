"""Draws the README's figures from the benchmarks' data files.

    python3 bench/plots/make_figures.py                 # all figures, into docs/images/
    python3 bench/plots/make_figures.py --data DIR --out DIR

Needs matplotlib (pip install matplotlib); the benchmarks themselves do not.

Each figure reads one CSV file in bench/plots/data/ and writes one SVG (text kept as text:
small, readable in any browser, and a change in the data is a readable diff). A data file is
comment lines "# key: value" (measured, device, cuda or software, date, command, and source
where the numbers were transcribed from a benchmark's printed table), free "#" comments, then
a header row and the rows. The keys become the figure's caption, so a figure always says what
was measured, on what, when, and the command that measures it again. `bench_pool --csv FILE`
writes its file in this form; the other files are transcribed from the tables their
benchmarks print, and say so.

Contract: every figure whose data file exists is drawn. A missing data file is named, with the
benchmark and the exact command that makes it, and the exit status is 1; so is a malformed
file (the file, its line, what is wrong) and a missing matplotlib (one sentence, the install
command). Nothing is written for a figure whose data is missing or malformed.
"""
import argparse
import csv
import os
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class DataError(Exception):
    """A data file that is missing or cannot be read as the figure needs it."""


# --- the figures ---------------------------------------------------------------------------
# Each: its data file, its SVG, the numeric columns it needs, and how the data is made.

FIGURES = [
    {
        "name": "pytorch_fragmentation",
        "data": "pytorch_fragmentation.csv",
        "svg": "pytorch_fragmentation.svg",
        "columns": {"trace": str, "allocator": str, "fraction": float},
        "made_by": "bench/python/run_all.py (PyTorch, a GPU): run "
                   "`python3 bench/python/run_all.py --only frag --seeds 1` and transcribe "
                   "its table into the file as trace,allocator,fraction rows under the "
                   "'# key: value' lines",
    },
    {
        "name": "pool_ns_per_op",
        "data": "pool_ns_per_op.csv",
        "svg": "pool_ns_per_op.svg",
        "columns": {"trace": str, "allocator": str, "ns_per_op": float},
        "made_by": "bench_pool (a GPU): run `BUILD_TYPE=Release BUILD_DIR=build-release ./run "
                   "bench pool --reps 7 --csv bench/plots/data/pool_ns_per_op.csv`",
    },
    {
        "name": "workload_limit",
        "data": "workload_limit.csv",
        "svg": "workload_limit.svg",
        "columns": {"allocator": str, "x_limit": float, "x_limit_min": float,
                    "x_limit_max": float, "peak_reserved_mib": float},
        "made_by": "bench_workload (a GPU): run `BUILD_TYPE=Release BUILD_DIR=build-release "
                   "./run bench workload --reps 7` and transcribe its table into the file as "
                   "allocator,steps_per_s,...,peak_reserved_mib rows under the '# key: value' "
                   "lines",
    },
]

# cudamem's rows in blues and greens, the peers in greys and warm colours: the same allocator
# has the same colour in every figure.
COLOURS = {
    "pool": "#1f5fa8", "vm_pool": "#4a90d9", "arena": "#2e8b57",
    "cudamem": "#1f5fa8", "cudamem with bulk blocks": "#7fb2e5",
    "limit": "#444444", "PyTorch default": "#9a9a9a", "expandable_segments": "#e0a040",
    "cudaMalloc": "#9a9a9a", "cudaMallocAsync": "#e0a040", "CUB": "#c8553d",
    "thrust": "#8c6bb1",
}
# What a name stands for, where the data's own name says too little.
NAMES = {
    "pool": "cudamem pool", "vm_pool": "cudamem vm_pool", "arena": "cudamem arena",
    "limit": "limit (no allocation)",
    "mixed": "mixed trace\n(large short-lived,\nsmall long-lived)",
    "heavy": "heavy trace\n(large ones kept up\nto half the device)",
    "swiss": "swiss cheese\n(128 MiB in freed\n64 MiB holes)",
    "pair_1MiB": "pair_1MiB\n(alloc+free 1 MiB)",
    "random_256B-4MiB": "random_256B-4MiB",
    "random_1KiB-64MiB": "random_1KiB-64MiB",
    "mt16_random_256B-1MiB": "mt16_random_256B-1MiB\n(16 threads)",
}


def named(name):
    return NAMES.get(name, name)


def number_label(value):
    """A bar's value: thousands with separators, smaller numbers to 4 significant digits."""
    return "{:,.0f}".format(value) if value >= 10000 else "%.4g" % value


# bench_workload's rows whose pools take the first block they find, whatever it waits for: an
# A/B the benchmark keeps, not a choice a user has. In the data, not in the picture.
LEFT_OUT_ROWS = ("pool-naive", "vm_pool-naive")


# --- data files ----------------------------------------------------------------------------

def read_data(path, columns):
    """(metadata, rows) of a data file: the "# key: value" lines, and each row as a dict whose
    `columns` are converted (str or float). Raises DataError naming the file and line."""
    if not os.path.isfile(path):
        raise DataError("%s is missing" % path)
    meta, body, body_lines = {}, [], []
    with open(path, newline="", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.startswith("#"):
                key, colon, value = line[1:].strip().partition(":")
                if colon and key and " " not in key.strip() and key.strip() not in meta:
                    meta[key.strip()] = value.strip()
            elif line.strip():
                body.append(line)
                body_lines.append(number)
    if not body:
        raise DataError("%s has no header row and no rows" % path)
    reader = csv.DictReader(body)
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise DataError("%s, line %d: the header lacks the column(s) %s (it has %s)"
                        % (path, body_lines[0], ", ".join(missing), reader.fieldnames))
    rows = []
    for index, record in enumerate(reader, start=1):
        number = body_lines[index]
        row = dict(record)
        for column, kind in columns.items():
            text = (record.get(column) or "").strip()
            try:
                row[column] = kind(text) if kind is float else text
            except ValueError:
                raise DataError("%s, line %d: %r in column %s is not a number"
                                % (path, number, text, column)) from None
            if kind is str and not text:
                raise DataError("%s, line %d: column %s is empty" % (path, number, column))
        rows.append(row)
    if not rows:
        raise DataError("%s has a header row and no rows" % path)
    return meta, rows


def in_order(values):
    """The distinct values, in the order they first appear."""
    return list(dict.fromkeys(values))


def caption(meta):
    """The figure's footnote: what, on what, when, how to measure it again, from where."""
    parts = []
    for key, label in (("measured", "Measured"), ("device", "On"), ("cuda", "CUDA"),
                       ("software", "Software"), ("date", "When"),
                       ("command", "Reproduce"), ("source", "Data")):
        if meta.get(key):
            parts.append("%s: %s." % (label, meta[key].rstrip(".")))
    return " ".join(parts)


# --- drawing -------------------------------------------------------------------------------

def new_figure(plt, meta, width, height):
    """A figure with the caption at its foot; returns (figure, the caption's height in inches)."""
    # Lines break at spaces only: a date or a command stays whole on its line.
    lines = textwrap.wrap(caption(meta), width=int(width * 19), break_on_hyphens=False,
                          break_long_words=False)
    figure = plt.figure(figsize=(width, height + 0.14 * len(lines)))
    figure.text(0.01, 0.01, "\n".join(lines), fontsize=6.5, color="#333333",
                va="bottom", ha="left", linespacing=1.3)
    return figure, 0.14 * len(lines) + 0.15


def grouped_bars(axes, groups, series, value_of, label_of, legend_of=named, log=False):
    """Bars grouped by `groups` (x), one per series in each group; a missing value is marked
    "not run". Each bar carries its value (label_of(value)); the legend names each series
    legend_of(series)."""
    width = 0.8 / len(series)
    labelled = set()  # one legend entry per series
    for s_index, name in enumerate(series):
        for g_index, group in enumerate(groups):
            x = g_index + (s_index - (len(series) - 1) / 2) * width
            value = value_of(group, name)
            if value is None:
                axes.text(x, axes.get_ylim()[0] if log else 0.01, "not run", rotation=90,
                          ha="center", va="bottom", fontsize=6, color="#777777")
                continue
            axes.bar(x, value, width * 0.92, color=COLOURS.get(name, "#777777"),
                     label=None if name in labelled else legend_of(name))
            labelled.add(name)
            axes.text(x, value * (1.08 if log else 1) + (0 if log else 0.01),
                      label_of(value), rotation=90, ha="center", va="bottom",
                      fontsize=6.5)
    axes.set_xticks(range(len(groups)))
    axes.set_xticklabels([named(g) for g in groups], fontsize=8)


def draw_pytorch_fragmentation(plt, meta, rows):
    traces = in_order(r["trace"] for r in rows)
    allocators = in_order(r["allocator"] for r in rows)
    value = {(r["trace"], r["allocator"]): r["fraction"] for r in rows}
    # The legend says where each series ran, where the data has the columns gpu and date.
    where = {r["allocator"]: ", ".join(r[c] for c in ("gpu", "date") if r.get(c))
             for r in rows}
    figure, foot = new_figure(plt, meta, 8.0, 4.2)
    axes = figure.add_axes([0.08, (foot + 0.8) / figure.get_figheight(), 0.58,
                            1 - (foot + 1.25) / figure.get_figheight()])
    axes.set_ylim(0, 1.22)
    grouped_bars(axes, traces, allocators, lambda t, a: value.get((t, a)),
                 lambda v: "%.3f" % v,
                 lambda a: "%s\n(%s)" % (named(a), where[a]) if where[a] else named(a))
    axes.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    axes.set_ylabel("live at the first OOM / free at the start\n(fraction of the device)",
                    fontsize=8)
    axes.axhline(1.0, color="#bbbbbb", linewidth=0.6, zorder=0)
    axes.set_title("How much of the GPU a PyTorch program can use before its first "
                   "out-of-memory error", fontsize=9.5)
    axes.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return figure


def draw_pool_ns_per_op(plt, meta, rows):
    traces = in_order(r["trace"] for r in rows)
    allocators = in_order(r["allocator"] for r in rows)
    value = {(r["trace"], r["allocator"]): r["ns_per_op"] for r in rows}
    figure, foot = new_figure(plt, meta, 8.0, 4.2)
    axes = figure.add_axes([0.09, (foot + 0.55) / figure.get_figheight(), 0.72,
                            1 - (foot + 1.0) / figure.get_figheight()])
    axes.set_yscale("log")
    low, high = min(value.values()), max(value.values())
    axes.set_ylim(low / 3, high * 40)
    grouped_bars(axes, traces, allocators, lambda t, a: value.get((t, a)), number_label,
                 log=True)
    axes.set_ylabel("ns per allocate or free (log scale)", fontsize=8)
    axes.set_title("Cost of an allocation or a free, cudamem's pool and arena against "
                   "their peers (bench_pool)", fontsize=9.5)
    axes.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return figure


def draw_workload_limit(plt, meta, rows):
    rows = [r for r in rows if r["allocator"] not in LEFT_OUT_ROWS]
    names = [named(r["allocator"]) for r in rows][::-1]  # top to bottom as in the data
    rows = rows[::-1]
    colours = [COLOURS.get(r["allocator"], "#777777") for r in rows]
    figure, foot = new_figure(plt, meta, 8.0, 3.6)
    bottom = (foot + 0.45) / figure.get_figheight()
    height = 1 - (foot + 0.95) / figure.get_figheight()
    speed = figure.add_axes([0.19, bottom, 0.43, height])
    memory = figure.add_axes([0.70, bottom, 0.27, height], sharey=speed)
    medians = [r["x_limit"] for r in rows]
    spread = [[m - r["x_limit_min"] for m, r in zip(medians, rows)],
              [r["x_limit_max"] - m for m, r in zip(medians, rows)]]
    speed.barh(names, medians, color=colours, xerr=spread, capsize=2,
               error_kw={"linewidth": 0.8, "ecolor": "#333333"})
    speed.axvline(1.0, color="#444444", linestyle="--", linewidth=0.8)
    for y, m in enumerate(medians):
        speed.text(0.02, y, "%.3f" % m, va="center", ha="left", fontsize=7, color="white")
    speed.set_xlim(0, 1.25)
    speed.set_xlabel("steps/s / the limit's in the same round\n(median; whiskers: min-max "
                     "of the rounds)", fontsize=8)
    speed.tick_params(labelsize=8)
    memory.barh(names, [r["peak_reserved_mib"] for r in rows], color=colours)
    memory.set_xscale("log")
    memory.set_xlim(50, 60000)
    for y, r in enumerate(rows):
        memory.text(r["peak_reserved_mib"] * 1.1, y, "%.0f" % r["peak_reserved_mib"],
                    va="center", fontsize=7)
    memory.set_xlabel("peak reserved, MiB (log scale)", fontsize=8)
    memory.tick_params(labelleft=False, labelsize=8)
    figure.suptitle("A training-like loop on 4 streams (bench_workload): speed against the "
                    "no-allocation limit, and memory", fontsize=9.5,
                    y=1 - 0.12 / figure.get_figheight())
    return figure


DRAW = {
    "pytorch_fragmentation": draw_pytorch_fragmentation,
    "pool_ns_per_op": draw_pool_ns_per_op,
    "workload_limit": draw_workload_limit,
}


# --- main ----------------------------------------------------------------------------------

def load_all(data_dir):
    """[(figure, meta, rows)] for the figures whose data reads well, and the error messages
    of the others (each a sentence or two: what is wrong, and how the data is made)."""
    loaded, errors = [], []
    for figure in FIGURES:
        path = os.path.join(data_dir, figure["data"])
        try:
            meta, rows = read_data(path, figure["columns"])
        except DataError as e:
            errors.append("%s: %s. The data comes from %s."
                          % (figure["name"], e, figure["made_by"]))
            continue
        loaded.append((figure, meta, rows))
    return loaded, errors


def import_pyplot():
    """matplotlib's pyplot, set up for small, stable SVG files; None when it is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"    # text as text: small, searchable, diffable
    matplotlib.rcParams["svg.hashsalt"] = "cudamem"  # the same ids on every run
    matplotlib.rcParams["font.size"] = 8
    import matplotlib.pyplot as plt
    return plt


def main(argv=None):
    parser = argparse.ArgumentParser(description="Draws the README's figures from the "
                                     "benchmarks' data files.")
    parser.add_argument("--data", default=os.path.join(HERE, "data"),
                        help="the data files' directory (default: bench/plots/data)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images"),
                        help="where the SVG files go (default: docs/images)")
    args = parser.parse_args(argv)

    loaded, errors = load_all(args.data)  # needs no matplotlib: checked first
    for message in errors:
        print("make_figures.py: " + message, file=sys.stderr)
    if loaded:
        plt = import_pyplot()
        if plt is None:
            print("make_figures.py: drawing needs matplotlib, which this Python lacks: "
                  "pip install matplotlib", file=sys.stderr)
            return 1
        os.makedirs(args.out, exist_ok=True)
        for figure, meta, rows in loaded:
            drawn = DRAW[figure["name"]](plt, meta, rows)
            path = os.path.join(args.out, figure["svg"])
            drawn.savefig(path, format="svg", metadata={"Date": None})
            plt.close(drawn)
            shown = os.path.relpath(path)
            print("wrote %s (%.1f KB)" % (path if shown.startswith("..") else shown,
                                          os.path.getsize(path) / 1000))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
