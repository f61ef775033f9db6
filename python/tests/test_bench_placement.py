"""bench/python/run_all.py's placement of the steps/s children (no GPU needed): which cores a
child is pinned to and, side by side, which GPU each allocator gets in each pass. A wrong
placement does not fail a benchmark, it skews it, so it is tested here."""
import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "python")


@pytest.fixture(scope="module")
def run_all():
    sys.path.insert(0, BENCH)  # run_all imports its neighbour common.py
    try:
        spec = importlib.util.spec_from_file_location("run_all", os.path.join(BENCH, "run_all.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(BENCH)


# Two sockets' worth: CPU c and c + 8 are hyperthread siblings of one core.
def siblings(cpu):
    core = cpu % 8
    return "%d,%d" % (core, core + 8)


TOPOLOGY_SAME = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\t0-15\t0\t\tN/A
GPU1\tNV18\t X \t0-15\t0\t\tN/A
"""

TOPOLOGY_APART = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tSYS\t0-3,8-11\t0\t\tN/A
GPU1\tSYS\t X \t4-7,12-15\t1\t\tN/A
"""


def test_affinity_is_read_from_its_column(run_all):
    assert run_all.gpu_cpu_affinity(TOPOLOGY_APART, 0) == "0-3,8-11"
    assert run_all.gpu_cpu_affinity(TOPOLOGY_APART, 1) == "4-7,12-15"
    assert run_all.gpu_cpu_affinity(TOPOLOGY_APART, 2) is None
    assert run_all.gpu_cpu_affinity(TOPOLOGY_SAME.replace("0-15", "N/A"), 0) is None
    assert run_all.gpu_cpu_affinity("", 0) is None


def test_one_cpu_per_physical_core(run_all):
    assert run_all.one_per_core("0-15", siblings) == "0,1,2,3,4,5,6,7"
    assert run_all.one_per_core("8-11", siblings) == "8,9,10,11"

    def unreadable(cpu):
        raise OSError("no sysfs")
    assert run_all.one_per_core("0-2", unreadable) == "0,1,2"  # kept as they are


def test_split_cpus_gives_disjoint_nearly_equal_groups(run_all):
    assert run_all.split_cpus("0-7", 2) == ["0,1,2,3", "4,5,6,7"]
    assert run_all.split_cpus("0-6", 3) == ["0,1,2", "3,4", "5,6"]
    groups = run_all.split_cpus("0-3,10-12", 2)
    assert groups == ["0,1,2,3", "10,11,12"]


def test_the_plan_swaps_gpus_every_pass(run_all):
    plan = run_all.side_by_side_plan(["default", "cudamem"], ["0", "1"],
                                     {"0": "0-3", "1": "4-7"}, 3)
    assert plan == [[("default", "0", "0-3"), ("cudamem", "1", "4-7")],
                    [("default", "1", "4-7"), ("cudamem", "0", "0-3")],
                    [("default", "0", "0-3"), ("cudamem", "1", "4-7")]]
    # Three allocators over three GPUs: each visits every GPU once in three passes.
    plan = run_all.side_by_side_plan(["a", "b", "c"], ["0", "1", "2"],
                                     {"0": "0", "1": "1", "2": "2"}, 3)
    for allocator in "abc":
        assert sorted(g for p in plan for a, g, _ in p if a == allocator) == ["0", "1", "2"]
    for p in plan:  # and no two share a GPU in a pass
        assert len({g for _, g, _ in p}) == 3


def test_gpus_with_one_affinity_split_its_physical_cores(run_all):
    plan = run_all.side_by_side_placement(["default", "cudamem"], TOPOLOGY_SAME, 2,
                                          gpus=["0", "1"], siblings_of=siblings)
    assert plan[0] == [("default", "0", "0,1,2,3"), ("cudamem", "1", "4,5,6,7")]
    assert plan[1] == [("default", "1", "4,5,6,7"), ("cudamem", "0", "0,1,2,3")]


def test_gpus_with_their_own_affinity_keep_it(run_all):
    plan = run_all.side_by_side_placement(["default", "cudamem"], TOPOLOGY_APART, 1,
                                          gpus=["0", "1"], siblings_of=siblings)
    assert plan[0] == [("default", "0", "0,1,2,3"), ("cudamem", "1", "4,5,6,7")]


def test_no_topology_splits_every_cpu(run_all):
    plan = run_all.side_by_side_placement(["default", "cudamem"], "", 1, gpus=["0", "1"],
                                          siblings_of=siblings, all_cpus="0-15")
    assert plan[0] == [("default", "0", "0,1,2,3"), ("cudamem", "1", "4,5,6,7")]


def test_too_few_gpus_fall_back_to_passes_in_turn(run_all, capsys):
    assert run_all.side_by_side_placement(["default", "cudamem"], TOPOLOGY_SAME, 2,
                                          gpus=["0"], siblings_of=siblings) is None
    assert "needs 2 GPUs, 1 visible" in capsys.readouterr().out
    assert run_all.side_by_side_placement(["default", "cudamem"], "", 2, gpus=[]) is None


FAKE_TRAIN = r'''
import os, sys, time
started = time.time()
time.sleep(1.0)
print("RESULT speed %s %.3f steps/s at batch 2, windows 1 2" % (
    os.environ["CUDAMEM_BENCH_ALLOCATOR"], 10.0 + int(os.environ["CUDA_VISIBLE_DEVICES"])))
print("NOTE placed gpu=%s cpus=%s started=%.3f time_calls=%s" % (
    os.environ["CUDA_VISIBLE_DEVICES"], sorted(os.sched_getaffinity(0)), started,
    "--time-calls" in sys.argv))
'''


def test_side_by_side_children_run_together_where_placed(run_all, tmp_path, monkeypatch, capsys):
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    monkeypatch.setattr(run_all, "HERE", str(tmp_path))
    monkeypatch.setattr(run_all, "show_notes", True)
    cpu = str(min(os.sched_getaffinity(0)))

    class Args:
        speed_passes, speed_window, profile_steps, speed_time_calls = 2, 50, 0, True
    placement = run_all.side_by_side_plan(["default", "cudamem"], ["0", "1"],
                                          {"0": cpu, "1": cpu}, 2)
    rows = run_all.speed_row(["default", "cudamem"], 2, 8, Args, placement)
    out = capsys.readouterr().out
    placed = [line.split()[1:] for line in out.splitlines() if "placed" in line]
    assert len(placed) == 4
    assert all(p[1] == "cpus=[%s]" % cpu for p in placed)
    assert all(p[3] == "time_calls=True" for p in placed)  # --speed-time-calls reaches them
    # Pass 1: default on GPU 0 (10 steps/s), cudamem on GPU 1 (11); pass 2 swapped.
    by_name = {name: row for name, row, _ in rows}
    ratio = next(row for name, row in by_name.items() if "over the default" in name)
    assert ratio["cudamem"] == pytest.approx((11.0 / 10.0 + 10.0 / 11.0) / 2)
    # The two children of a pass started together, not one after the other.
    starts = [float(p[2].split("=")[1]) for p in placed]
    assert abs(starts[0] - starts[1]) < 0.8 and abs(starts[2] - starts[3]) < 0.8


FAKE_CHATTY = r'''
import os, sys, time
if os.environ["CUDA_VISIBLE_DEVICES"] == "0":
    time.sleep(1.0)  # waited for first; meanwhile the other writes
else:
    for _ in range(2000):  # 200 KB: more than a pipe holds
        sys.stdout.write("NOTE " + "y" * 95 + "\n")
    sys.stdout.flush()
print("NOTE finished %.3f" % time.time())
print("RESULT speed %s 10.0 steps/s at batch 2, windows 1" % os.environ["CUDAMEM_BENCH_ALLOCATOR"])
'''


def test_a_child_waited_for_later_is_not_held_up_by_its_output(
        run_all, tmp_path, monkeypatch, capsys):
    (tmp_path / "train.py").write_text(FAKE_CHATTY)
    monkeypatch.setattr(run_all, "HERE", str(tmp_path))
    monkeypatch.setattr(run_all, "show_notes", True)
    cpu = str(min(os.sched_getaffinity(0)))
    quiet = run_all.start("train.py", "default", cpus=cpu, gpu="0")
    chatty = run_all.start("train.py", "cudamem", cpus=cpu, gpu="1")
    assert run_all.finish(quiet) and run_all.finish(chatty)
    finished = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()
                if "finished" in line]
    assert len(finished) == 2
    # The chatty child wrote 200 KB and ended while the quiet one still slept.
    assert finished[1] < finished[0] - 0.5
