"""Rollout engines by name: the built-in two, one more registered, an unknown name refused."""

import argparse

import pytest

from actor_integration.rollout import ReferenceEngine, registry
from actor_integration.rollout.registry import (
    UnknownEngineError,
    check_engine_name,
    engine_class,
    engine_entry,
    engine_names,
    register_engine,
)


@pytest.fixture
def restore_registry(monkeypatch):
    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))


class TestEngineRegistry:
    def test_reference_sglang_and_vllm_are_registered_by_name(self):
        assert engine_names()[:3] == ("reference", "sglang", "vllm")
        assert engine_entry("vllm").path == "actor_integration.engines.vllm.offline:VLLMEngine"
        assert engine_class("reference") is ReferenceEngine
        assert engine_entry("sglang").path == "actor_integration.engines.sglang.engine:SGLangEngine"

    def test_an_unknown_name_lists_the_known_ones(self):
        with pytest.raises(
            UnknownEngineError, match=r"unknown rollout engine 'vlm'.*'reference', 'sglang'"
        ) as info:
            check_engine_name("vlm")
        assert info.value.known == engine_names()
        with pytest.raises(ValueError):
            engine_class("vlm")

    def test_a_registered_engine_is_loaded_only_when_asked_for(self, restore_registry):
        entry = register_engine("later", "no_such_package.engine:Engine", "imported on use")
        assert "later" in engine_names() and entry.description == "imported on use"
        with pytest.raises(ModuleNotFoundError, match="no_such_package"):
            engine_class("later")

    def test_a_name_taken_by_another_class_is_refused_unless_replaced(self, restore_registry):
        with pytest.raises(ValueError, match="already registered"):
            register_engine("sglang", "somewhere.else:Engine")
        register_engine("sglang", "actor_integration.rollout.reference:ReferenceEngine", replace=True)
        assert engine_class("sglang") is ReferenceEngine
        with pytest.raises(ValueError, match="module:attribute"):
            register_engine("broken", "no_colon")

    def test_the_demo_reads_its_engines_from_the_registry(self, restore_registry):
        from actor_integration.tools.demo.options import add_demo_arguments
        from actor_integration.tools.demo.placement import Placement

        register_engine("other", "actor_integration.rollout.reference:ReferenceEngine")
        parser = argparse.ArgumentParser()
        add_demo_arguments(parser)
        assert parser.parse_args(["--engine", "other"]).engine == "other"
        with pytest.raises(SystemExit):
            parser.parse_args(["--engine", "nothing-registered"])
        with pytest.raises(
            ValueError, match=r"engine must be one of \['reference', 'sglang', 'vllm', 'other'\]"
        ):
            Placement.__post_init__(argparse.Namespace(engine="nothing-registered"))
