"""The SGLang wheels' source (the oldest and newest release the adapters support), for the tests
that check our adapters against it: every test taking `sglang_tree` runs once per version."""

import os

import pytest

from tests.helpers.sglang_source import (
    OFFLINE_ENV,
    VERSIONS,
    SourceTree,
    WheelUnavailable,
    cached_wheel,
    fetch_wheel,
)


def _wheel(version: str):
    """SGLang's wheel. CI reaches the package registry, so a failed download fails the test;
    `RL_LIFECYCLE_OFFLINE=1` skips instead on a machine that cannot reach it."""
    if os.environ.get(OFFLINE_ENV) == "1":
        wheel = cached_wheel(version)
        if wheel is None:
            pytest.skip(
                f"{OFFLINE_ENV}=1 and sglang {version}'s wheel is not cached: the source checks need it"
            )
    else:
        try:
            wheel = fetch_wheel(version)
        except WheelUnavailable as exc:
            pytest.fail(
                f"cannot fetch sglang {version}'s wheel to check the adapters against its source: {exc}. "
                f"On a machine without the package registry set {OFFLINE_ENV}=1 to skip these checks.",
                pytrace=False,
            )
    return wheel


@pytest.fixture(scope="session", params=VERSIONS)
def sglang_tree(request):
    tree = SourceTree(_wheel(request.param), request.param)
    yield tree
    tree.close()
