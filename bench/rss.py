"""Run a command and report its own peak RSS: `python bench/rss.py CMD ...`.

Linux carries a process's high-water RSS across exec, and a child forked (or
vforked) from the big benchmark process starts with the parent's high-water
mark. Launching through this small, fresh interpreter keeps that inherited
mark below anything a real command uses, so ru_maxrss is the command's own.
The last line on stderr is `BENCH_PEAK_RSS_KIB=<n>`; the exit code is the
command's."""

import os
import subprocess
import sys


def main() -> int:
    proc = subprocess.Popen(sys.argv[1:])
    _, status, usage = os.wait4(proc.pid, 0)
    sys.stderr.write(f"\nBENCH_PEAK_RSS_KIB={usage.ru_maxrss}\n")
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
