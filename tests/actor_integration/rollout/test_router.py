"""`RouterWorkers`: one server added to and removed from a router through each of the worker APIs
slime and miles use, against a local router (`FakeRouter`) over HTTP."""

from __future__ import annotations

import pytest

from actor_integration.errors import RouterError
from actor_integration.rollout.router import RouterWorkers
from tests.helpers.framework_source import free_port
from tests.helpers.sglang_server import FakeRouter

WORKER = "http://127.0.0.1:15000"


@pytest.fixture
def router():
    router = FakeRouter()
    yield router
    router.close()


class TestRouterWorkers:
    @pytest.mark.parametrize("api", ["workers", "workers_by_url", "legacy"])
    def test_a_server_is_added_and_removed_through_the_routers_own_api(self, router, api):
        workers = RouterWorkers(router.url, WORKER, api=api)
        workers.add()
        assert router.urls() == [WORKER]
        assert workers.remove() is True
        assert router.urls() == []
        paths = [path.split("?")[0] for _, path, _ in router.calls]
        expected = {
            "workers": ["/workers", "/workers", "/workers/w0"],
            "workers_by_url": ["/workers", "/workers/http%3A%2F%2F127.0.0.1%3A15000"],
            "legacy": ["/add_worker", "/remove_worker"],
        }[api]
        assert paths == expected

    def test_removing_a_server_the_router_does_not_list_is_no_error(self, router):
        assert RouterWorkers(router.url, WORKER).remove() is False

    def test_listed_says_whether_the_router_lists_the_server(self, router):
        workers = RouterWorkers(router.url, WORKER)
        assert workers.listed() is False
        workers.add()
        assert workers.listed() is True
        assert RouterWorkers(router.url, WORKER, api="legacy").listed() is None

    def test_a_refusal_is_a_router_error_with_the_status_and_the_routers_words(self, router):
        workers = RouterWorkers(router.url, WORKER)
        workers.add()
        with pytest.raises(RouterError) as refused:
            workers.add()  # already registered: the router answers 409
        assert refused.value.fields["status"] == 409 and "already exists" in refused.value.fields["answer"]
        assert refused.value.fields["worker"] == WORKER and refused.value.fields["operation"] == "add"

    def test_an_unreachable_router_is_a_router_error_naming_it(self):
        url = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(RouterError, match="could not be reached") as unreachable:
            RouterWorkers(url, WORKER, timeout_s=2).remove()
        assert unreachable.value.fields["status"] is None and unreachable.value.fields["router"] == url

    def test_miles_own_router_adds_and_lists_but_cannot_remove(self):
        """miles' router (`--use-miles-router`): `/add_worker` (a second add is no error) and
        `/list_workers`; with no removal route, remove() refuses before sending anything."""
        router = FakeRouter(kind="miles")
        try:
            workers = RouterWorkers(router.url, WORKER, api="miles")
            assert workers.removable is False and workers.listed() is False
            workers.add()
            workers.add()
            assert router.urls() == [WORKER] and workers.listed() is True
            sent = len(router.calls)
            with pytest.raises(RouterError, match="no route that removes a worker") as refused:
                workers.remove()
            assert len(router.calls) == sent and router.urls() == [WORKER]
            assert refused.value.fields["operation"] == "remove" and refused.value.fields["status"] is None
        finally:
            router.close()
        assert all(RouterWorkers("http://r", WORKER, api=api).removable for api in ("workers", "legacy"))

    def test_miles_chooses_its_own_routers_api_with_use_miles_router(self):
        from types import SimpleNamespace

        from actor_integration.frameworks.miles.rollout import MilesRolloutMixin

        engine = MilesRolloutMixin()
        engine.args = SimpleNamespace(use_miles_router=True)
        assert engine.lifecycle_router_api() == "miles"

    def test_arguments_are_checked(self):
        with pytest.raises(ValueError, match="api must be one of"):
            RouterWorkers("http://r", WORKER, api="grpc")
        with pytest.raises(ValueError, match="timeout_s"):
            RouterWorkers("http://r", WORKER, timeout_s=0)
