"""AReaL's rollout engine under the rollout table, against a server that answers as SGLang 0.5.17 does.

The engines are AReaL-shaped (tests/helpers/areal_like.py: the calls and requests of AReaL
cbff54d6); the server is `FakeSGLangServer` over HTTP with AReaL's AWEX plugin in its scheduler
(`awex_fake_server`). Each field failure is run twice: AReaL's own sequence breaks the server or
hangs a request; the same calls through `ArealRolloutMixin` do not. The same sequences on AReaL's
own classes: test_areal_source.py.
"""

from __future__ import annotations

import os

import pytest

from actor_integration.errors import EngineNotIdleError
from actor_integration.frameworks.areal import IDLE_POLL_ENV, ArealRolloutMixin
from actor_integration.rollout.engine import ABORT_THEN_IN_PLACE
from lifecycle import Contents, Residency, State
from lifecycle.errors import IllegalTransitionError, InvalidWeightsError
from tests.helpers.areal_like import (
    LifecycleEngineLike,
    LifecycleRemoteEngineLike,
    MegatronEngineLike,
    Meta,
    RemoteEngineLike,
    awex_fake_server,
    http_rollout,
    http_send,
    publish_to,
    recover_like,
)

HANG_S = 1.5  # a request still unanswered after this long is waiting on a pause nobody lifts


@pytest.fixture
def server():
    made = awex_fake_server()
    yield made
    made.close()


def request(server, timeout_s: float = HANG_S) -> str:
    """One of the workflow's requests: "served", "hung" (no answer in time) or "refused: ..."."""
    import urllib.request

    data = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}'
    req = urllib.request.Request(
        f"{server.url}/generate", data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as reply:
            reply.read()
            return "served"
    except TimeoutError:
        return "hung"
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return "hung"
        return f"refused: {exc.reason}"
    except OSError as exc:  # the connection closed unanswered: the server died
        return f"refused: {exc!r}"


def paths(server) -> list[str]:
    """The requests the server received, a pause with its mode (AReaL's first one has none: abort)."""
    return [
        f"{path} {body.get('mode', 'abort')}" if path == "/pause_generation" else path
        for _method, path, body in server.requests
    ]


def run_trainer(server, *, wrapped: bool):
    """A trainer rank whose writer publishes to `server`'s AWEX plugin, and its rollout engine."""
    rollout = http_rollout(server, wrapped=wrapped)
    trainer = (LifecycleEngineLike if wrapped else MegatronEngineLike)()
    trainer.rollout_engine = rollout
    trainer.publish = publish_to(server.url)
    trainer.offload()  # rl_trainer: the actor offloaded before SGLang starts
    return trainer, rollout


class TestFullyIdle:
    """SGLang's release asserts a fully idle scheduler (AReaL's #1500 ablation: pausing in place
    without draining tripped it on the third step)."""

    def test_plain_a_pause_in_place_without_draining_kills_the_server_at_the_release(self, server):
        rollout = http_rollout(server, wrapped=False)
        server.queued = {"running": 2, "waiting": 0}  # the rollout's requests in flight
        http_send(server.url, "/pause_generation", {"mode": "in_place"})  # the ablation: no abort
        with pytest.raises(OSError):
            rollout.offload(tags=["kv_cache"])
        assert "only when server is idle" in server.deaths[0]

    def test_wrapped_the_two_step_pause_drains_before_anything_is_released(self, server):
        rollout = http_rollout(server, wrapped=True)
        server.queued = {"running": 2, "waiting": 0}
        rollout.offload(tags=["kv_cache"])
        rollout.offload(tags=["weights"])
        assert server.alive and server.released == {"kv_cache", "weights"}
        assert paths(server) == [
            "/pause_generation abort",  # AReaL's first pause: drains the running requests
            "/pause_generation in_place",  # its second: the scheduler's flag
            "/flush_cache",  # idle: the release may go
            "/release_memory_occupation",
            "/flush_cache",  # the second sleep finds generation paused: still idle?
            "/release_memory_occupation",
        ]
        assert [body["tags"] for _m, p, body in server.requests if p == "/release_memory_occupation"] == [
            ["kv_cache"],
            ["weights"],
        ]

    def test_wrapped_in_the_ablations_mode_the_release_is_refused_not_fatal(self, server):
        """Pausing in place only leaves the requests running: the flush says so, and nothing is released."""

        class InPlaceOnly(LifecycleRemoteEngineLike):
            lifecycle_pause_mode = "in_place"

        rollout = http_rollout(server, wrapped=True, cls=InPlaceOnly)
        server.queued = {"running": 2, "waiting": 0}
        with pytest.raises(EngineNotIdleError, match="still queued"):
            rollout.offload(tags=["kv_cache"])
        assert server.alive and server.released == set()
        assert rollout.lifecycle.state is State.FAILED
        assert rollout.lifecycle.failure.residency["kv_cache"] is Residency.RESIDENT


class TestKVCacheLeftReleased:
    """AReaL #1726: a KV cache left released while generation stayed paused hung admission."""

    def test_plain_a_continue_with_the_kv_cache_released_lets_a_request_reach_released_memory(self, server):
        rollout = http_rollout(server, wrapped=False)
        rollout.pause_generation()
        rollout.offload(tags=["kv_cache"])
        rollout.continue_generation()
        assert request(server).startswith("refused")
        assert "kv_cache" in server.deaths[0]

    def test_wrapped_the_continue_waits_for_the_wake_and_the_request_is_served(self, server):
        rollout = http_rollout(server, wrapped=True)
        rollout.pause_generation()
        rollout.offload(tags=["kv_cache"])
        rollout.continue_generation()  # held: the KV cache is released
        assert "/continue_generation" not in paths(server)
        rollout.resume()  # the workflow's admission: the engine is woken first
        assert request(server) == "served"
        assert paths(server)[-3:] == ["/resume_memory_occupation", "/continue_generation", "/generate"]

    def test_plain_the_recover_path_without_a_checkpoint_leaves_requests_hanging(self, server):
        """RecoverHandler.load pauses and offloads the rollout, the checkpoint load raises
        FileNotFoundError, the finally resumes the workflow only, and the error is swallowed."""
        trainer, rollout = run_trainer(server, wrapped=False)
        recover_like(trainer, rollout, 7, checkpoint=False)  # returns, as AReaL's does
        assert server.paused and server.released == {"kv_cache", "weights"}
        assert request(server) == "hung"

    def test_wrapped_the_recover_paths_finally_refuses_admission_on_discarded_weights(self, server):
        trainer, rollout = run_trainer(server, wrapped=True)
        with pytest.raises(InvalidWeightsError, match="discarded"):
            recover_like(trainer, rollout, 7, checkpoint=False)
        # woken: every tag resident, so nothing reads released memory
        assert rollout.lifecycle.state is State.AWAKE
        assert rollout.lifecycle.contents["weights"] is Contents.DISCARDED
        assert server.alive and server.released == set()


class TestMissingContinue:
    """AReaL #1160 / #1180: a disk weight update that paused generation and never continued it
    hung every later rollout request."""

    def disk_update_without_continue(self, rollout) -> None:
        rollout.pause_generation()
        rollout.update_weights_from_disk(Meta(type="disk", version=3)).result()

    def test_plain_requests_wait_forever(self, server):
        rollout = http_rollout(server, wrapped=False)
        self.disk_update_without_continue(rollout)
        assert request(server) == "hung"

    def test_wrapped_the_whole_version_continues_generation(self, server):
        rollout = http_rollout(server, wrapped=True)
        self.disk_update_without_continue(rollout)
        assert request(server) == "served"
        assert rollout.lifecycle.weight_version == 3
        assert rollout.lifecycle.contents["weights"] is Contents.VALID

    def test_wrapped_a_failed_load_leaves_the_weights_unknown_and_admission_refused(self, server):
        rollout = http_rollout(server, wrapped=True)
        server.refuse_weights = "model path does not exist"
        rollout.pause_generation()
        with pytest.raises(RuntimeError, match="does not exist"):
            rollout.update_weights_from_disk(Meta(type="disk", version=3)).result()
        assert rollout.lifecycle.contents["weights"] is Contents.UNKNOWN
        with pytest.raises(InvalidWeightsError):
            rollout.resume()


class TestTransferOrdering:
    """AReaL's AWEX plugin reads its weight queue only while the scheduler is paused in place (and
    AReaL #1737 removed the idle-loop polling that read it otherwise): a transfer published before
    that pause is never read, and the writer waits for it until its timeout."""

    def test_plain_the_recover_path_without_the_engine_pause_never_transfers(self, server):
        """recover.py's own comment: without pause_generation_sync the recover-path transfer deadlocks."""
        trainer, rollout = run_trainer(server, wrapped=False)
        rollout.pause()  # the controller's pause only: the workflow, not the server
        with pytest.raises(RuntimeError, match="never came"):
            trainer.update_weights(Meta(version=1))

    def test_wrapped_the_update_pauses_in_place_and_releases_first(self, server):
        trainer, rollout = run_trainer(server, wrapped=True)
        rollout.pause()
        trainer.update_weights(Meta(version=1))
        rollout.resume()
        assert server.transfers == [1] and request(server) == "served"
        assert rollout.lifecycle.state is State.AWAKE and rollout.lifecycle.weight_version == 1
        # the plugin resumed the weights in the scheduler: the wrap resumed only the KV cache
        resumed = [body["tags"] for _m, p, body in server.requests if p == "/resume_memory_occupation"]
        assert resumed == [["kv_cache"]]


class TestRolloutCalls:
    def test_a_second_offload_is_a_noop_where_plain_areal_kills_the_server(self, server):
        wrapped = http_rollout(server, wrapped=True)
        wrapped.offload(tags=["weights"])
        wrapped.offload(tags=["weights"])
        assert server.alive
        plain_server = awex_fake_server()
        try:
            plain = http_rollout(plain_server, wrapped=False)
            plain.offload(tags=["weights"])
            with pytest.raises(OSError):
                plain.offload(tags=["weights"])
            assert "Cannot pause allocation" in plain_server.deaths[0]
        finally:
            plain_server.close()

    def test_an_onload_of_a_resident_tag_is_a_noop_where_plain_areal_kills_the_server(self, server):
        wrapped = http_rollout(server, wrapped=True)
        wrapped.onload(tags=["kv_cache"])
        assert server.alive and "/resume_memory_occupation" not in paths(server)
        plain = http_rollout(server, wrapped=False)
        with pytest.raises(OSError):
            plain.onload(tags=["kv_cache"])
        assert "KeyError" in server.deaths[0]

    def test_the_pause_is_sent_once_until_the_continue(self, server):
        rollout = http_rollout(server, wrapped=True)
        rollout.pause_generation()
        rollout.offload()
        pauses = [p for p in paths(server) if p.startswith("/pause_generation")]
        assert pauses == ["/pause_generation abort", "/pause_generation in_place"]
        # the sleep checks that the pause still holds an idle scheduler
        assert paths(server).count("/flush_cache") == 2

    def test_a_transfer_reported_into_resident_weights_is_refused_naming_the_call(self, server):
        rollout = http_rollout(server, wrapped=True)
        with pytest.raises(IllegalTransitionError, match="lifecycle_before_weights_update"):
            rollout.lifecycle_weights_updated(1)

    def test_unknown_tags_are_refused_naming_the_tracked_ones(self, server):
        rollout = http_rollout(server, wrapped=True)
        with pytest.raises(ValueError, match=r"tracks \['kv_cache', 'weights'\]"):
            rollout.offload(tags=["cuda_graph"])

    def test_a_disk_update_needs_an_int_version(self, server):
        rollout = http_rollout(server, wrapped=True)
        with pytest.raises(ValueError, match=r"meta\.with_version"):
            rollout.update_weights_from_disk(Meta(type="disk", version=None))

    def test_an_unknown_pause_mode_is_refused(self, server):
        class Typo(LifecycleRemoteEngineLike):
            lifecycle_pause_mode = "drain"

        with pytest.raises(ValueError, match=ABORT_THEN_IN_PLACE):
            Typo([server.url], http_send).offload()

    def test_no_server_yet_is_refused_with_what_to_call(self):
        with pytest.raises(IllegalTransitionError, match="launch_server"):
            LifecycleRemoteEngineLike([], http_send).offload()


class Launcher:
    def launch_server(self, server_args):
        return dict(os.environ)


class LaunchedEngine(ArealRolloutMixin, Launcher):
    pass


class TestLaunch:
    def test_an_awex_server_is_launched_with_idle_polling_off(self, monkeypatch):
        monkeypatch.delenv(IDLE_POLL_ENV, raising=False)
        env = LaunchedEngine().launch_server({"awex_colocate_mode": True})
        assert env[IDLE_POLL_ENV] == "0"

    def test_idle_polling_asked_for_is_refused_naming_the_issue(self, monkeypatch):
        monkeypatch.setenv(IDLE_POLL_ENV, "1")
        with pytest.raises(ValueError, match="#1737"):
            LaunchedEngine().launch_server({"awex_colocate_mode": True})

    def test_a_server_without_awex_is_launched_as_areal_launches_it(self, monkeypatch):
        monkeypatch.delenv(IDLE_POLL_ENV, raising=False)
        monkeypatch.delenv("AWEX_META_SERVER_ADDR", raising=False)
        assert IDLE_POLL_ENV not in LaunchedEngine().launch_server({})


def test_plain_engine_is_areals_shape():
    """The plain engine sends what AReaL's SGLangBackend sends (compared with AReaL's own in the source suite)."""
    sent: list = []
    engine = RemoteEngineLike(["a"], lambda address, endpoint, payload: sent.append((endpoint, payload)))
    engine.pause_generation()
    engine.offload(tags=["kv_cache"])
    assert sent == [
        ("/pause_generation", {}),
        ("/pause_generation", {"mode": "in_place"}),
        ("/release_memory_occupation", {"tags": ["kv_cache"]}),
    ]
