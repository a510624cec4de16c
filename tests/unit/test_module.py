"""chatgen.module: the garbage-collection pause around model startup (`startup_gc`)."""

import gc

import pytest

from chatgen.module import Module, startup_gc


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
