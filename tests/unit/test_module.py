"""chatgen.module: the garbage-collection pauses around model startup (`startup_gc`) and generation
calls (`collection_paused`)."""

import gc
import threading

import pytest

from chatgen.module import Module, collection_paused, startup_gc


@pytest.fixture(autouse=True)
def gc_restored():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def made_inside_is_frozen(obj) -> bool:
    return not any(o is obj for o in gc.get_objects())  # frozen objects are in no generation


def test_collection_is_paused_inside_and_what_was_made_is_frozen_after():
    gc.enable()
    with startup_gc():
        assert not gc.isenabled()
        made = [[]]  # a tracked container
        assert not made_inside_is_frozen(made)
    assert gc.isenabled() and made_inside_is_frozen(made)


def test_nested_blocks_are_one_pause_and_a_disabled_collector_stays_disabled():
    gc.enable()
    with startup_gc():
        with startup_gc():
            pass
        assert not gc.isenabled()  # the inner block does not resume what the outer paused
    assert gc.isenabled()
    gc.disable()
    with startup_gc():
        pass
    assert not gc.isenabled()  # a user who turned collection off keeps it off


def test_collection_resumes_when_startup_fails():
    gc.enable()
    with pytest.raises(RuntimeError, match="setup failed"):
        with startup_gc():
            raise RuntimeError("setup failed")
    assert gc.isenabled()


def test_module_start_builds_with_collection_paused():
    seen = []

    class Probe(Module):
        def init(self):
            seen.append(gc.isenabled())

        def setup(self):
            seen.append(gc.isenabled())
            self.built = [[]]

    gc.enable()
    probe = Probe().start()
    assert seen == [False, False] and gc.isenabled() and made_inside_is_frozen(probe.built)


def test_generation_pause_resumes_after_the_last_of_overlapping_blocks():
    """Blocks of two threads that overlap (a server's calls): collection stays off until the last
    one ends, is on after it, and nothing is frozen."""
    gc.enable()
    entered, leave = threading.Event(), threading.Event()

    def other_call():
        with collection_paused():
            entered.set()
            leave.wait(10)

    with collection_paused():
        made = [[]]
        thread = threading.Thread(target=other_call)
        thread.start()
        assert entered.wait(10) and not gc.isenabled()
    assert not gc.isenabled()  # the other call still runs
    leave.set()
    thread.join(10)
    assert gc.isenabled() and not made_inside_is_frozen(made)
    gc.disable()
    with pytest.raises(RuntimeError, match="call failed"):
        with collection_paused():
            raise RuntimeError("call failed")
    assert not gc.isenabled()  # off before: off after
