"""AReaL's own colocate code (its source at the pinned commit) under the AReaL adapters.

What runs from AReaL's source (tests/helpers/areal_source.py): its `AwexMegatronAdapter` (release,
resume, grad buffers, the writer's transfer) over megatron-core's own buffer offload on CPU
tensors; its `SGLangBackend` request builders; its `RecoverHandler.load`; its SGLang plugin's
patched scheduler loops and `process_awex_queue`, on two gloo ranks, at HEAD and at the commit
with the idle-loop polling #1737 removed. The server is the 0.5.17 fake with the AWEX plugin's
rule (`awex_fake_server`). Needs AReaL's source: CI has no network, so the suite skips there; run

    RL_LIFECYCLE_AREAL_SOURCE=/path/to/AReaL python -m pytest -s tests/actor_integration/frameworks/areal/test_areal_source.py

(a checkout or a git directory holding cbff54d6 and 7cad29b6).
"""

from __future__ import annotations

import dataclasses
import tempfile

import pytest

from tests.actor_integration.frameworks.areal.test_areal_rollout import request
from tests.helpers.areal_like import RemoteEngineLike, awex_fake_server, http_rollout
from tests.helpers.areal_source import (
    BACKEND,
    IDLE_POLL_COMMIT,
    IO_STRUCT,
    ArealSource,
    plugin_rank,
    recover_rank,
    run_definitions,
    writer_rank,
)
from tests.helpers.framework_source import suite_source
from tests.helpers.spawn import no_crash, run_world

SOURCE: ArealSource | None
SOURCE, pytestmark, _source_readable = suite_source(ArealSource, "AReaL's")

DEADLINE_S = 180.0


@pytest.fixture
def server():
    made = awex_fake_server()
    yield made
    made.close()


def _one(worker, *args):
    assert SOURCE is not None
    results = run_world(worker, 1, str(SOURCE.location), SOURCE.commit, *args, deadline_s=DEADLINE_S)
    no_crash(results)
    return results[0]


class TestAReaLsWriter:
    """AReaL's AwexMegatronAdapter: the machine's residency is its `_released_tags`, through its transfer."""

    def test_wrapped_the_transfer_leaves_the_machine_where_areals_writer_left_the_memory(self, server):
        result = _one(writer_rank, server.url, True, "onload")
        after = result["after_update"]
        assert after["released"] == after["machine"] == ["optimizer", "weights"] and after["storage"] == 0
        assert result["weights"] == [
            2.0,
            3.0,
            4.0,
            5.0,
        ]  # the trained step, back through megatron's own reload
        assert server.transfers == [1] and request(server) == "served"

    def test_plain_a_save_after_the_transfer_reads_the_storage_areal_released(self, server):
        result = _one(writer_rank, server.url, False, "save")
        assert "storage AReaL released" in result["violation"]

    def test_wrapped_a_save_after_the_transfer_wakes_first(self, server):
        result = _one(writer_rank, server.url, True, "save")
        assert result["saved"] == [2.0, 3.0, 4.0, 5.0] and "violation" not in result


class TestAReaLsRequests:
    """The requests the adapters send, against AReaL's own SGLangBackend builders."""

    @pytest.fixture(scope="class")
    def backend(self):
        assert SOURCE is not None
        namespace: dict = {"dataclass": dataclasses.dataclass, "field": dataclasses.field}
        run_definitions(SOURCE, IO_STRUCT, ("HttpRequest", "WeightUpdateRequests"), namespace)
        return run_definitions(SOURCE, BACKEND, ("SGLangBackend",), namespace)["SGLangBackend"]()

    def test_the_areal_shaped_engine_sends_areals_requests(self, backend):
        sent = []
        engine = RemoteEngineLike(["a"], lambda address, endpoint, payload: sent.append((endpoint, payload)))
        engine.pause_generation()
        engine.offload(tags=["kv_cache"])
        engine.onload(tags=["kv_cache"])
        engine.continue_generation()
        areal = [
            *backend.get_pause_requests(),
            backend.get_offload_request(tags=["kv_cache"]),
            backend.get_onload_request(tags=["kv_cache"]),
            backend.get_resume_request(),
        ]
        assert sent == [(r.endpoint, r.payload) for r in areal]

    def test_the_wrap_sends_areals_requests_and_a_flush(self, backend, server):
        rollout = http_rollout(server, wrapped=True)
        rollout.offload(tags=["kv_cache"])
        rollout.onload(tags=["kv_cache"])
        sent = [(path, body) for _m, path, body in server.requests]
        pause_abort, pause_in_place = backend.get_pause_requests()
        release = backend.get_offload_request(tags=["kv_cache"])
        resume = backend.get_onload_request(tags=["kv_cache"])
        assert sent == [
            (pause_abort.endpoint, {"mode": "abort"}),  # AReaL sends {}: SGLang's default mode, spelled out
            (pause_in_place.endpoint, pause_in_place.payload),
            ("/flush_cache", None),  # not AReaL's: the check that the pause left the scheduler idle
            (release.endpoint, release.payload),
            (resume.endpoint, resume.payload),
            (backend.get_resume_request().endpoint, backend.get_resume_request().payload),
        ]
        assert pause_abort.payload == {}


class TestAReaLsRecover:
    """AReaL's RecoverHandler.load, colocate branch (AReaL #1726: a KV cache left released while
    generation stayed paused hung admission)."""

    def _recover(self, server, *, wrapped, checkpoint):
        with tempfile.TemporaryDirectory(prefix="areal-recover-") as root:
            return _one(recover_rank, server.url, wrapped, checkpoint, root)

    def test_plain_a_missing_checkpoint_is_swallowed_and_the_rollout_left_paused_and_released(self, server):
        assert self._recover(server, wrapped=False, checkpoint=False) == {"returned": None}
        assert server.paused and server.released == {"kv_cache", "weights"}
        assert request(server) == "hung"

    def test_wrapped_the_finally_refuses_admission_instead(self, server):
        result = self._recover(server, wrapped=True, checkpoint=False)
        assert result["raised"] == "InvalidWeightsError"
        assert server.alive and server.released == set()

    @pytest.mark.parametrize("wrapped", [False, True])
    def test_with_its_checkpoint_both_push_the_next_version_and_serve(self, server, wrapped):
        assert self._recover(server, wrapped=wrapped, checkpoint=True) == {"returned": 3}
        assert server.transfers == [4] and request(server) == "served"


class TestAReaLsPlugin:
    """AReaL's SGLang plugin on two TP ranks over gloo. #1737: the idle-loop polling (7cad29b6) votes
    on each rank's own loop count, and a rank one loop iteration off enters the vote's all_reduce
    while the other broadcasts requests; without it (HEAD) the queue is read only while paused in
    place, which the wrap's sleep does before every transfer."""

    IDLE = [[]] * 8

    def _ranks(self, commit, script, *, drift, idle_poll):
        assert SOURCE is not None
        return run_world(
            plugin_rank, 2, str(SOURCE.location), commit, script, drift, idle_poll, deadline_s=DEADLINE_S
        )

    def test_plain_idle_polling_with_drifted_loops_desynchronises_the_collectives(self):
        results = self._ranks(
            IDLE_POLL_COMMIT, [*self.IDLE, ["publish:1"], *self.IDLE], drift=True, idle_poll="1"
        )
        assert all("error" in r for r in results), results  # gloo's timeout, then the peer's closed pair
        assert all(r["loaded"] == [] for r in results)

    def test_plain_idle_polling_in_lockstep_loads(self):
        """The same code with the loops in lockstep: what #1613's own comment relies on."""
        results = self._ranks(
            IDLE_POLL_COMMIT, [*self.IDLE, ["publish:1"], *self.IDLE], drift=False, idle_poll="1"
        )
        assert [r["loaded"] for r in results] == [[1], [1]]

    def test_wrapped_paused_only_with_drifted_loops_loads(self):
        """As the wrap launches the plugin (idle polling off) and orders the transfer (paused in place first)."""
        script = [*self.IDLE, ["pause_in_place"], ["publish:1"], [], [], ["continue"], *self.IDLE]
        results = self._ranks(IDLE_POLL_COMMIT, script, drift=True, idle_poll="0")
        assert [r["loaded"] for r in results] == [[1], [1]]
        assert [r["resumed"] for r in results] == [[["weights"]], [["weights"]]]

    def test_head_never_reads_a_transfer_published_without_the_pause_in_place(self):
        assert SOURCE is not None
        results = self._ranks(
            SOURCE.commit, [*self.IDLE, ["publish:1"], *self.IDLE], drift=True, idle_poll="1"
        )
        no_crash(results)
        assert [r["loaded"] for r in results] == [[], []]  # the writer waits for weights_update_finished

    def test_head_reads_it_once_paused_in_place(self):
        assert SOURCE is not None
        script = [*self.IDLE, ["pause_in_place"], ["publish:1"], [], [], ["continue"], *self.IDLE]
        results = self._ranks(SOURCE.commit, script, drift=True, idle_poll="1")
        assert [r["loaded"] for r in results] == [[1], [1]]
