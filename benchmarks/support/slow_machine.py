"""Run a command as on a slower machine (`make test-slow`): a spinner on each CPU, at real-time
priority, takes `--taken` of every 10 ms, so whatever the command runs, one thread or many,
gets the rest of each CPU and no more. `--taken 0.5` is a machine twice as slow. Needs the
right to real-time scheduling (root, or CAP_SYS_NICE).

    python -m benchmarks.support.slow_machine --taken 0.5 -- make test
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

PERIOD = 0.01  # s: short enough that no test sees whole CPUs come and go


def spin(cpu: int, taken: float) -> None:
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    while True:
        end = time.monotonic() + taken * PERIOD
        while time.monotonic() < end:
            pass
        time.sleep((1 - taken) * PERIOD)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--taken", type=float, default=0.5, help="the share of each CPU taken, below 0.95")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not 0 < args.taken < 0.95:  # Linux leaves real-time tasks 95% of a CPU at most
        parser.error("give a command after -- and a --taken between 0 and 0.95")
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        sys.exit("real-time scheduling is not allowed here: run as root (or with CAP_SYS_NICE)")
    spinners = [
        multiprocessing.Process(target=spin, args=(cpu, args.taken), daemon=True) for cpu in os.sched_getaffinity(0)
    ]
    for spinner in spinners:
        spinner.start()
    try:
        sys.exit(subprocess.call(command))
    finally:
        for spinner in spinners:
            spinner.kill()


if __name__ == "__main__":
    main()
