"""Shared test set-up: lifecycle events off the console, and one local Ray cluster per session."""

import io
import os
import shutil
import tempfile

import pytest

import lifecycle

lifecycle.configure_logging(stream=io.StringIO(), level="warning")
# Actors the tests start (Ray workers inherit this) write their per-rank logs here, not into the checkout;
# removed after a session that passed, kept (and named) after one that failed.
_LOG_DIR = None
if "RL_LIFECYCLE_LOG_DIR" not in os.environ:
    _LOG_DIR = os.environ["RL_LIFECYCLE_LOG_DIR"] = tempfile.mkdtemp(prefix="rl-lifecycle-test-logs-")


def pytest_sessionfinish(session, exitstatus):
    if _LOG_DIR is None:
        return
    if exitstatus == 0:
        shutil.rmtree(_LOG_DIR, ignore_errors=True)
    else:
        print(f"\nthe test actors' lifecycle logs are kept in {_LOG_DIR}")


def start_local_ray(ray):
    """The session's one-node cluster (a module that needs another, the multi-node tests, restarts it after)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster (2 CPUs' worth of actors on the CI machine), shared by all tests."""
    ray = pytest.importorskip("ray")
    start_local_ray(ray)
    yield ray
    ray.shutdown()
