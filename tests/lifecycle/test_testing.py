"""The fakes of `lifecycle.testing` fail where the real backends fail."""

import threading

import pytest

from lifecycle.testing import FakeMemorySaver, ProtocolViolation

DISABLE_ASSERT = "disable\\(\\) should be called only when tms is active"


class TestFakeMemorySaverDisable:
    """torch_memory_saver's disable() asserts its per-thread active flag (entrypoint.py), and so does the fake."""

    def test_a_nested_disable_asserts(self):
        saver = FakeMemorySaver()
        with saver.disable(), pytest.raises(AssertionError, match=DISABLE_ASSERT), saver.disable():
            pass

    def test_disable_outside_a_region_without_init_enable_asserts(self):
        saver = FakeMemorySaver(init_enable=False)
        with pytest.raises(AssertionError, match=DISABLE_ASSERT), saver.disable():
            pass

    def test_disable_inside_a_region_turns_allocations_plain(self):
        saver = FakeMemorySaver(init_enable=False)
        with saver.region("weights"):
            assert saver.active
            with saver.disable():
                assert saver.disabled
                with saver.region("weights"), saver.disable():  # a region inside re-enables TMS
                    pass
            assert saver.active
        assert not saver.active

    def test_the_flag_is_per_thread(self):
        saver = FakeMemorySaver()
        seen: list[bool] = []
        with saver.disable():
            thread = threading.Thread(target=lambda: seen.append(saver.active))
            thread.start()
            thread.join()
        assert seen == [True]  # TMS_INIT_ENABLE starts every thread active

    def test_hook_mode_is_write_only(self):
        saver = FakeMemorySaver()
        saver.hook_mode = "preload"
        with pytest.raises(AttributeError):
            _ = saver.hook_mode


class TestFakeMemorySaverPause:
    def test_double_pause_is_a_violation(self):
        saver = FakeMemorySaver()
        saver.pause()
        with pytest.raises(ProtocolViolation, match="Cannot pause allocation that is not active"):
            saver.pause()
