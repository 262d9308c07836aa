"""OptimizerCtx: thread local, nestable, restores the outer state on exit."""

from __future__ import annotations

import threading

import pytest

from roundpipe import OptimizerCtx


def test_enter_exit_and_nesting():
    assert not OptimizerCtx.is_active()
    with OptimizerCtx():
        assert OptimizerCtx.is_active()
        with OptimizerCtx(enabled=False):
            assert not OptimizerCtx.is_active()
            with OptimizerCtx():
                assert OptimizerCtx.is_active()
            assert not OptimizerCtx.is_active()
        assert OptimizerCtx.is_active()
    assert not OptimizerCtx.is_active()


def test_exit_on_exception_restores_state():
    with pytest.raises(KeyError):
        with OptimizerCtx():
            raise KeyError("boom")
    assert not OptimizerCtx.is_active()


def test_same_instance_reentered():
    ctx = OptimizerCtx()
    with ctx:
        with ctx:
            assert OptimizerCtx.is_active()
        assert OptimizerCtx.is_active()
    assert not OptimizerCtx.is_active()
    with ctx:
        assert OptimizerCtx.is_active()


def test_thread_local():
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen["other"] = OptimizerCtx.is_active()
        with OptimizerCtx():
            seen["inner"] = OptimizerCtx.is_active()
            release.set()

    t = threading.Thread(target=other)
    t.start()
    with OptimizerCtx():
        entered.set()
        release.wait(5)
        t.join(5)
        assert OptimizerCtx.is_active()
    assert seen == {"other": False, "inner": True}


def test_enabled_must_be_bool():
    with pytest.raises(TypeError, match="enabled"):
        OptimizerCtx(enabled=1)


def test_one_instance_entered_by_two_threads():
    ctx = OptimizerCtx()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with ctx:
            a_in.set()
            b_in.wait(5)
        a_out.set()
        seen["a_after"] = OptimizerCtx.is_active()

    def b():
        a_in.wait(5)
        with ctx:
            b_in.set()
            a_out.wait(5)
            seen["b_inside"] = OptimizerCtx.is_active()
        seen["b_after"] = OptimizerCtx.is_active()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert seen == {"a_after": False, "b_inside": True, "b_after": False}
