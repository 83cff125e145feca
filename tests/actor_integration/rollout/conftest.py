"""The pinned SGLang wheel's source, for the tests that check our adapters against it."""

import os

import pytest

from tests.helpers.sglang_source import (
    OFFLINE_ENV,
    VERSION,
    SourceTree,
    WheelUnavailable,
    cached_wheel,
    fetch_wheel,
)


@pytest.fixture(scope="session")
def sglang_tree():
    """SGLang's parsed source. CI reaches the package registry, so a failed download fails the
    test; `RL_LIFECYCLE_OFFLINE=1` skips instead on a machine that cannot reach it."""
    if os.environ.get(OFFLINE_ENV) == "1":
        wheel = cached_wheel()
        if wheel is None:
            pytest.skip(
                f"{OFFLINE_ENV}=1 and sglang {VERSION}'s wheel is not cached: the source checks need it"
            )
    else:
        try:
            wheel = fetch_wheel()
        except WheelUnavailable as exc:
            pytest.fail(
                f"cannot fetch sglang {VERSION}'s wheel to check the adapters against its source: {exc}. "
                f"On a machine without the package registry set {OFFLINE_ENV}=1 to skip these checks.",
                pytrace=False,
            )
    tree = SourceTree(wheel)
    yield tree
    tree.close()
