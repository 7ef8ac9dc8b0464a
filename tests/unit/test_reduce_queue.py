"""The in-flight reduction queue (`comm/inflight.py`): bound, start-order finishing, early finishing."""
import pytest

from zerospeed.comm.inflight import ReduceQueue


class FakeHandle:
    def __init__(self, name, log, completed=False):
        self.name, self.log, self.completed = name, log, completed

    def is_completed(self):
        return self.completed

    def wait(self):
        self.log.append(f"wait {self.name}")


def _push(q, log, name, completed=False):
    q.push(FakeHandle(name, log, completed), lambda: log.append(f"done {name}"))


def test_bounded_queue_blocks_on_the_oldest_and_finishes_in_start_order():
    log = []
    q = ReduceQueue(2)
    for name in "abc":
        _push(q, log, name, completed=True)  # completed, but not finished early without finish_early
    assert log == ["wait a", "done a"] and len(q) == 2 and q.peak == 3
    q.wait_all()
    assert log == ["wait a", "done a", "wait b", "done b", "wait c", "done c"] and len(q) == 0


def test_finish_early_takes_completed_ones_from_the_front_only():
    log = []
    q = ReduceQueue(2, finish_early=True)
    _push(q, log, "a")                   # not completed: stays
    _push(q, log, "b", completed=True)   # completed, but behind a: stays
    assert log == [] and q.peak == 2
    q._queue[0][0].completed = True
    _push(q, log, "c")                   # a and b done now, c not
    assert log == ["wait a", "done a", "wait b", "done b"] and len(q) == 1 and q.peak == 3


def test_unbounded_queue_keeps_everything_until_wait_all():
    log = []
    q = ReduceQueue(None)
    for i in range(10):
        _push(q, log, str(i), completed=True)
    assert log == [] and q.peak == 10
    q.wait_all()
    assert [x for x in log if x.startswith("done")] == [f"done {i}" for i in range(10)]
    with pytest.raises(ValueError, match="max_in_flight"):
        ReduceQueue(0)
