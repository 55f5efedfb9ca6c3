"""Which waits count as compute waiting on I/O: the main thread's, and those of a thread that runs backward
hooks for autograd (a GPU's backward runs there); not those of the engine's own workers."""

from __future__ import annotations

import threading

import pytest
import torch

import infinity
from infinity.runtime.trace import Timeline


def _wait_on(thread_name: str | None, timeline: Timeline) -> None:
    def run():
        timeline.waited(1.0, 1.5, "fetch")
    thread = threading.Thread(target=run, name=thread_name) if thread_name else threading.Thread(target=run)
    thread.start()
    thread.join()


def test_waits_of_the_main_thread_and_of_autograds_thread_count_and_workers_do_not():
    timeline = Timeline()
    timeline.waited(0.0, 0.25, "fetch")  # the main thread
    _wait_on(None, timeline)  # autograd's device thread: a thread the engine did not make
    _wait_on("infinity-optimizer", timeline)  # the step's worker reads ahead off the critical path
    timeline.add("compute", "backward", 0.0, 2.0)
    summary = timeline.close_step()
    assert summary["compute_s"] == 2.0 - 0.25 - 0.5


def test_reads_and_writes_each_count_their_time_in_flight():
    # reads in flight over [0, 2] and [3, 4], writes over [1, 3.5]: 3 s of reads, 2.5 s of writes, the disk
    # busy either way over [0, 4]
    timeline = Timeline()
    timeline.add("nvme read", "a", 0.0, 1.5)
    timeline.add("nvme read", "b", 1.0, 2.0)
    timeline.add("nvme read", "c", 3.0, 4.0)
    timeline.add("nvme write", "d", 1.0, 3.5)
    summary = timeline.close_step()
    assert (summary["nvme_read_s"], summary["nvme_write_s"], summary["io_s"]) == (3.0, 2.5, 4.0)


def test_a_trace_path_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    """The trace is written when the engine closes: a missing folder (or a folder given as the file) would fail only
    after the training, and lose the trace. ``initialize`` refuses it naming ``trace.path``, before any shard is
    made; a path with ``{rank}`` is checked for this rank's file."""
    for path, says in [(tmp_path / "nowhere" / "t.json", "does not exist"), (tmp_path, "is a folder")]:
        with pytest.raises(ValueError, match=f"trace.path .*{says}"):
            infinity.initialize(torch.nn.Linear(4, 4), {"trace": {"path": str(path)}})
    engine = infinity.initialize(torch.nn.Linear(4, 4), {"trace": {"path": str(tmp_path / "t-{rank}.json")}})
    engine.close()
    assert (tmp_path / "t-0.json").is_file()
