"""A mixin-wrapped actor class under a real local Ray cluster, driven by LifecycleGroup."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from actor_integration import (
    DeadActorsError,
    GroupCallError,
    GroupTimeoutError,
    InconsistentGroupError,
    LifecycleGroup,
)
from actor_integration.actors.ray_group import log_dir_runtime_env
from lifecycle.checker import check_files
from tests.helpers.slime_like import LifecycleSlimeActor

pytestmark = pytest.mark.ray


class SlowSlimeActor(LifecycleSlimeActor):
    """Adds a way to make every hook slow, to kill or time out the actor mid-transition."""

    def set_hook_delay(self, seconds: float, hook: str = "clear_memory") -> None:
        """Make one hook slow (clear_memory or process_groups.reload), to catch the actor inside it."""
        if hook == "clear_memory":
            target, name = self, "clear_memory"
        else:
            target, name = self.groups, "reload"
        original = getattr(target, name)

        def slow(*args):
            time.sleep(seconds)
            return original(*args)

        setattr(target, name, slow)
        self.lifecycle._callables.clear()  # re-bind on next use
        if hook == "clear_memory":
            self.lifecycle.hooks = self.lifecycle.hooks.replace(clear_memory=slow)

    def ping(self) -> str:
        return "pong"

    def fail_next(self, hook: str) -> None:
        """Make the next call of a memory hook raise (the actor's fakes take an injector)."""
        from lifecycle.testing import FaultInjector

        self.tms.faults = FaultInjector()
        self.tms.faults.arm(hook)


@pytest.fixture(scope="module")
def remote_cls(ray_cluster):
    # Test-module classes are not importable by Ray workers: ship them by value.
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_cluster.remote(SlowSlimeActor)


def make_actors(ray, remote_cls, n, tmp_path, **options):
    actors = [remote_cls.options(**options).remote() for _ in range(n)]
    ray.get([a.configure_logs.remote(str(tmp_path / f"rank{i}.jsonl")) for i, a in enumerate(actors)])
    ray.get([a.init.remote(rank=i) for i, a in enumerate(actors)])
    return actors


class TestLogsByDefault:
    def test_wrapped_actors_write_per_rank_logs_where_the_runtime_env_says(
        self, ray_cluster, remote_cls, tmp_path
    ):
        """No logging code in the actors: RL_LIFECYCLE_LOG_DIR through Ray's runtime_env puts each
        rank's `<role>-rank<rank>.jsonl` there, the group says where, and `lifecycle check` is clean."""
        ray = ray_cluster
        env = log_dir_runtime_env(tmp_path / "logs")
        actors = [remote_cls.options(runtime_env=env).remote() for _ in range(2)]
        ray.get([a.init.remote(rank=i) for i, a in enumerate(actors)])
        group = LifecycleGroup(actors, timeout_s=60)
        group.call("train", 1)
        group.wake_up()
        group.sleep()
        paths = group.log_paths()
        assert sorted(paths) == [0, 1]
        assert {Path(p).parent for p in paths.values()} == {(tmp_path / "logs").resolve()}
        assert sorted(Path(p).name for p in paths.values()) == ["actor-rank0.jsonl", "actor-rank1.jsonl"]
        ray.get([a.flush_logs.remote() for a in actors])
        assert check_files([tmp_path / "logs"]) == []
        for a in actors:
            ray.kill(a)


class TestSlimeOrder:
    def test_init_asleep_train_save_update(self, ray_cluster, remote_cls, tmp_path):
        """slime's call order through Ray: every rank consistent after each step; logs per actor."""
        ray = ray_cluster
        actors = make_actors(ray, remote_cls, 2, tmp_path)
        group = LifecycleGroup(actors, timeout_s=30)
        assert {s["state"] for s in group.assert_consistent().values()} == {"PAUSED"}
        assert group.call("train", 1) == {0: {"rollout_id": 1}, 1: {"rollout_id": 1}}
        group.call("save_model", 1)
        assert group.call("update_weights") == {0: 1, 1: 1}
        states = group.assert_consistent()
        assert all(s["state"] == "PAUSED" and s["groups"] == "destroyed" for s in states.values())
        group.wake_up()
        group.sleep()
        group.sleep()  # idempotent across the group
        assert group.assert_consistent()[0]["residency"] == {"*": "released"}
        ray.get([a.flush_logs.remote() for a in actors])
        for rank in (0, 1):
            events = [json.loads(line) for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]
            assert {e["rank"] for e in events} == {rank}
            kinds = [e["event"] for e in events]
            assert kinds[0] == "lifecycle.configured"
            assert kinds.count("lifecycle.noop") >= 1 + 4  # the group's second sleep + nested calls in bodies
            ops = [e["operation"] for e in events if e["event"] == "lifecycle.body"]
            assert ops == ["train", "save", "sync"]
        for a in actors:
            ray.kill(a)

    def test_inconsistent_ranks_are_named(self, ray_cluster, remote_cls, tmp_path):
        ray = ray_cluster
        actors = make_actors(ray, remote_cls, 3, tmp_path)
        group = LifecycleGroup(actors, timeout_s=30)
        ray.get(actors[2].wake_up.remote())
        with pytest.raises(
            InconsistentGroupError, match=r"AWAKE residency \{'\*': 'resident'\}: ranks \[2\]"
        ) as info:
            group.assert_consistent()
        assert info.value.groups["PAUSED residency {'*': 'released'}"] == [0, 1]
        for a in actors:
            ray.kill(a)

    def test_errors_come_back_with_their_rank(self, ray_cluster, remote_cls, tmp_path):
        """A refused operation on one rank surfaces as GroupCallError naming that rank and the reason."""
        ray = ray_cluster
        actors = make_actors(ray, remote_cls, 2, tmp_path)
        group = LifecycleGroup(actors, timeout_s=30)
        with pytest.raises(GroupCallError, match=r"recover raised on ranks \[0, 1\].*only legal from FAILED"):
            group.call("lifecycle_recover", "AWAKE")
        for a in actors:
            ray.kill(a)


class TestHeldScope:
    def test_every_rank_in_one_scope_wakes_once_and_sleeps_once(self, ray_cluster, remote_cls, tmp_path):
        """reef #202's step on two ranks inside group.held(): one resume, pause, reload and destroy per rank,
        every rank held and released together, and logs the checker finds clean."""
        ray = ray_cluster
        actors = make_actors(ray, remote_cls, 2, tmp_path)
        group = LifecycleGroup(actors, timeout_s=30)
        before = {r: ray.get(a.calls_made.remote()) for r, a in enumerate(actors)}  # init ends asleep
        with group.held():
            assert {(s["state"], s["holds"]) for s in group.states().values()} == {("PAUSED", 1)}
            group.wake_up()  # the slot restore's wake
            group.call("train", 1)
            group.call("save_model", 1)
            assert group.call("update_weights") == {0: 1, 1: 1}
            states = group.states()
            assert {(s["state"], tuple(s["deferred"])) for s in states.values()} == {("AWAKE", ("*",))}
        states = group.assert_consistent()
        assert {(s["state"], s["holds"], s["groups"]) for s in states.values()} == {
            ("PAUSED", 0, "destroyed")
        }
        for rank, actor in enumerate(actors):
            made = ray.get(actor.calls_made.remote())[len(before[rank]) :]
            counts = {n: made.count(n) for n in ("memory.resume", "memory.pause")}
            counts |= {n: made.count(n) for n in ("process_groups.reload", "process_groups.destroy")}
            assert set(counts.values()) == {1}, (rank, made)
        ray.get([a.flush_logs.remote() for a in actors])
        assert check_files([tmp_path]) == []
        for a in actors:
            ray.kill(a)

    def test_a_rank_that_refuses_the_hold_leaves_no_rank_holding(self, ray_cluster, remote_cls, tmp_path):
        """A FAILED rank refuses the hold; the ranks that took it give it back before the error is raised."""
        ray = ray_cluster
        actors = make_actors(ray, remote_cls, 2, tmp_path)
        group = LifecycleGroup(actors, timeout_s=30)
        ray.get(actors[1].fail_next.remote("memory.resume"))
        with pytest.raises(GroupCallError, match=r"wake_up raised on ranks \[1\]"):
            group.wake_up()
        with (
            pytest.raises(GroupCallError, match=r"lifecycle_hold raised on ranks \[1\].*hold is refused"),
            group.held(),
        ):
            pytest.fail("the block of a scope that was not taken must not run")
        states = group.states()
        assert (states[0]["holds"], states[1]["holds"], states[1]["state"]) == (0, 0, "FAILED")
        for a in actors:
            ray.kill(a)


class TestThreadedActor:
    def test_concurrent_calls_wait_on_the_lock(self, ray_cluster, remote_cls, tmp_path):
        """A threaded actor (max_concurrency=4) takes train, save, sleep and wake_up concurrently, consistently."""
        ray = ray_cluster
        (actor,) = make_actors(ray, remote_cls, 1, tmp_path, max_concurrency=4)
        refs = []
        for i in range(10):
            refs += [
                actor.train.remote(i),
                actor.save_model.remote(i),
                actor.sleep.remote(),
                actor.wake_up.remote(),
            ]
        ray.get(refs, timeout=60)
        state = ray.get(actor.lifecycle_state.remote())
        assert state["state"] in ("AWAKE", "PAUSED") and state["failure"] is None
        names = ray.get(actor.calls_made.remote())
        assert names.count("body.train") == 0 and sum(n.startswith("body.train") for n in names) == 10
        ray.kill(actor)


class TestDeadlines:
    def test_timeout_names_the_rank(self, ray_cluster, remote_cls, tmp_path):
        ray = ray_cluster
        actors = make_actors(ray, remote_cls, 2, tmp_path)
        ray.get(actors[1].set_hook_delay.remote(5.0, "process_groups.reload"))
        group = LifecycleGroup(actors, timeout_s=30)
        with pytest.raises(
            GroupTimeoutError, match=r"wake_up: ranks \[1\] did not answer within 1.0 s"
        ) as info:
            group.wake_up(timeout_s=1.0)
        assert info.value.missing == [1]
        for a in actors:
            ray.kill(a)

    @pytest.mark.parametrize(
        ("method", "hook", "before"),
        [
            ("sleep", "clear_memory", "AWAKE"),
            ("save_model", "clear_memory", "PAUSED"),
            ("update_weights", "process_groups.reload", "PAUSED"),
        ],
    )
    def test_dead_rank_is_reported_and_fanout_refused(
        self, ray_cluster, remote_cls, tmp_path, method, hook, before
    ):
        """An actor killed inside sleep, save or sync: the group names it with its last known state within 30 s,
        then refuses to fan out until the caller decides."""
        ray = ray_cluster
        actors = make_actors(ray, remote_cls, 2, tmp_path)
        group = LifecycleGroup(actors, timeout_s=30)
        if before == "AWAKE":
            group.wake_up()
        group.states()
        ray.get(actors[1].set_hook_delay.remote(20.0, hook))
        killer = threading.Timer(0.5, lambda: ray.kill(actors[1]))
        killer.start()
        started = time.monotonic()
        args = (1,) if method == "save_model" else ()
        with pytest.raises(DeadActorsError, match=rf"ranks \[1\] died .*rank 1: last known {before}") as info:
            group.call(method, *args)
        assert time.monotonic() - started < 30
        assert info.value.dead[1]["state"] == before
        with pytest.raises(DeadActorsError, match="refusing lifecycle_state"):
            group.states()
        group.forget(1)
        assert list(group.states()) == [0]
        ray.kill(actors[0])
