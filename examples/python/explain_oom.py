"""An out-of-memory error that explains itself: another process holds part of the GPU, this
one fills the rest, and the error names the other process (pid, name, bytes), what this
process holds and why the request failed.

    pip install ./python                  # once (the README: "From PyTorch, CuPy and Numba")
    python3 examples/python/explain_oom.py

It uses the installed package, as any program would: PyTorch and a CUDA device are needed to
run it, and it ends with the out-of-memory error's text.

PyTorch's own message says how much PyTorch holds and how much is free; it cannot say who
holds the rest. cudamem asks the driver (NVML) which processes use the device.
"""
import subprocess
import sys

GiB = 1 << 30

HOLDER = """
import sys, torch
x = torch.empty(%d, dtype=torch.uint8, device="cuda")   # held until stdin closes
print("holding", flush=True)
sys.stdin.read()
"""


def main():
    import torch
    import cudamem.torch
    cudamem.torch.install()
    # Another process (a second training job, a notebook left open) holds 4 GiB.
    other = subprocess.Popen([sys.executable, "-c", HOLDER % (4 * GiB)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        if other.stdout.readline().strip() != "holding":
            sys.exit("the other process did not start")
        print("another process (pid %d) holds 4 GiB; filling the rest of the device" % other.pid)
        tensors = []
        try:
            while True:
                tensors.append(torch.empty(2 * GiB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            print("\ntorch.OutOfMemoryError after %d tensors of 2 GiB:\n" % len(tensors))
            print(str(e))
    finally:
        other.stdin.close()
        other.wait()


if __name__ == "__main__":
    main()
