"""A 256 MiB answer streamed through each adapter: once it outgrows the body
cap nothing more of it is held, so the process's peak memory stays flat
(it would grow by the whole answer if the capture buffered it). Each
adapter runs in a fresh process so its peak RSS is its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

# Far below the 256 MiB streamed: what the interpreter, a framework's
# buffers and the allocator may add, never the answer itself.
FLAT_KIB = 32 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["wsgi", "asgi", "fastapi", "flask", "django"])
def test_peak_memory_stays_flat_while_a_256_mib_answer_streams_through(adapter, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tests.e2e.stream_rss", adapter, str(tmp_path / "ledger.db")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    first, replay, grew_kib = (int(x) for x in done.stdout.split())
    # Over the cap: stored as the oversize sentinel, and the retry is replayed.
    assert (first, replay) == (500, 500)
    assert grew_kib < FLAT_KIB
