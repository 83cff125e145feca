"""The launch switch on slime's and miles' own source: where each class is resolved, read from the
pinned commits, and the replacement taking effect in slime's and miles' own launchers (the critic
built by slime's `allocate_train_group` with no `actor_cls`, as `create_training_models` builds it).

Needs the sources (CI has none, so these skip there); run with

    RL_LIFECYCLE_SLIME_SOURCE=/path/to/slime RL_LIFECYCLE_MILES_SOURCE=/path/to/miles \\
        python -m pytest tests/actor_integration/frameworks/test_launch_source.py
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from actor_integration.frameworks import launch
from tests.helpers.framework_source import FrameworkSource, error_of
from tests.helpers.miles_source import MilesSource
from tests.helpers.slime_source import SlimeSource, rollout, slime_args
from tests.helpers.spawn import no_crash, run_world


def _source(cls: type[FrameworkSource]) -> Any:
    if cls.SOURCE_ENV not in os.environ:
        pytest.skip(f"{cls.SOURCE_ENV} is not set: {cls.HOW_TO_RUN}")
    return cls.find()


@pytest.fixture(scope="module")
def slime() -> SlimeSource:
    source: SlimeSource = _source(SlimeSource)
    return source


@pytest.fixture(scope="module")
def miles() -> MilesSource:
    source: MilesSource = _source(MilesSource)
    return source


def _tree(source: FrameworkSource, path: str) -> ast.Module:
    return ast.parse(source.read(path))


def _function(tree: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    found = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    ]
    assert found, f"no function {name}"
    return found[0]


def _imports(tree: ast.AST, module: str) -> set[str]:
    return {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == module
        for a in n.names
    }


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _called(call: ast.Call) -> str:
    return ast.unparse(call.func)


def _driver_order(source: FrameworkSource, path: str) -> list[str]:
    """The launcher calls of a driver, in the order its train function makes them; and no ray.init."""
    tree = _tree(source, path)
    names = [
        _called(c)
        for c in sorted(_calls(tree), key=lambda c: (c.lineno, c.col_offset))
        if _called(c)
        in ("create_placement_groups", "create_rollout_manager", "create_training_models", "ray.init")
    ]
    return list(dict.fromkeys(names))


class TestWhereSlimeResolvesEachClass:
    def test_every_module_the_switch_reads_is_in_the_pinned_source(self, slime: SlimeSource) -> None:
        for replacement in launch.SLIME.replacements:
            for module in (replacement.module, replacement.defined_in):
                tree = _tree(slime, module.replace(".", "/") + ".py")
                assert replacement.name in _imports(tree, replacement.defined_in) or any(
                    isinstance(n, ast.ClassDef) and n.name == replacement.name for n in tree.body
                ), (module, replacement.name)
        assert launch.SLIME.preflight_at is not None
        module, _, function = launch.SLIME.preflight_at.partition(":")
        started = _function(_tree(slime, module.replace(".", "/") + ".py"), function)
        assert [a.arg for a in started.args.args][:1] == ["args"]

    def test_the_trainer_class_is_resolved_by_module_and_name_in_the_driver_for_actor_and_critic(
        self, slime: SlimeSource
    ) -> None:
        allocate = _function(_tree(slime, "slime/ray/actor_group.py"), "_allocate_gpus_for_actor")
        assert "MegatronTrainRayActor" in _imports(allocate, "slime.backends.megatron_utils.actor")
        assert any(_called(c).startswith("ray.remote") for c in _calls(allocate))
        models = _function(_tree(slime, "slime/ray/placement_group.py"), "create_training_models")
        critic = [
            c
            for c in _calls(models)
            if _called(c) == "allocate_train_group" and any(k.arg == "role" for k in c.keywords)
        ]
        assert len(critic) == 1 and not any(k.arg == "actor_cls" for k in critic[0].keywords)

    def test_the_engine_class_is_read_from_the_rollout_modules_globals_in_the_rollout_manager(
        self, slime: SlimeSource
    ) -> None:
        tree = _tree(slime, "slime/ray/rollout.py")
        assert "SGLangEngine" in _imports(tree, "slime.backends.sglang_utils.sglang_engine")
        start = _function(tree, "start_engines")
        assert "ray.remote(SGLangEngine)" in {ast.unparse(c) for c in _calls(start)}
        manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutManager")
        assert "start_rollout_servers" in {_called(c) for c in _calls(manager)}

    def test_trains_driver_order_starts_ray_before_any_class_is_resolved_and_never_calls_ray_init(
        self, slime: SlimeSource
    ) -> None:
        """Why the documented `ray.init(runtime_env=...)` before create_rollout_manager raised
        "ray.init twice": create_placement_groups has started Ray already."""
        for driver in ("train.py", "train_async.py"):
            assert _driver_order(slime, driver) == [
                "create_placement_groups",
                "create_rollout_manager",
                "create_training_models",
            ], driver


class TestWhereMilesResolvesEachClass:
    def test_every_module_the_switch_reads_is_in_the_pinned_source(self, miles: MilesSource) -> None:
        for replacement in launch.MILES.replacements:
            for module in (replacement.module, replacement.defined_in):
                tree = _tree(miles, module.replace(".", "/") + ".py")
                assert replacement.name in _imports(tree, replacement.defined_in) or any(
                    isinstance(n, ast.ClassDef) and n.name == replacement.name for n in tree.body
                ), (module, replacement.name)
        module, _, function = str(launch.MILES.preflight_at).partition(":")
        assert [a.arg for a in _function(_tree(miles, module.replace(".", "/") + ".py"), function).args.args][
            :1
        ] == ["args"]

    def test_the_trainer_and_the_engine_are_resolved_by_module_and_name(self, miles: MilesSource) -> None:
        factory = _function(_tree(miles, "miles/ray/train/actor_factory.py"), "allocate_gpus_for_actor")
        assert "MegatronTrainRayActor" in _imports(factory, "miles.backends.megatron_utils.actor")
        group = _tree(miles, "miles/ray/rollout/server_group.py")
        assert "SGLangEngine" in _imports(group, "miles.backends.sglang_utils.sglang_engine")
        assert any("SGLangEngine" in ast.unparse(c) and "ray.remote" in ast.unparse(c) for c in _calls(group))

    def test_both_drivers_start_ray_first_and_never_call_ray_init(self, miles: MilesSource) -> None:
        for driver in ("train.py", "train_async.py"):
            assert _driver_order(miles, driver) == [
                "create_placement_groups",
                "create_rollout_manager",
                "create_training_models",
            ], driver


# ---------------------------------------------------------------------------------------------- in process


def _no_cuda_major_probe() -> None:
    """This CPU torch has no CUDA major: torch_memory_saver's own lookup of the preload library is
    answered with the CUDA 13 build (a GPU machine's torch names its major itself)."""
    from actor_integration.backends.tms_env import preload_library

    sys.modules["torch_memory_saver.utils"].get_binary_path_from_package = lambda stem: Path(
        preload_library(13)
    )


def _slime_critic(rank: int, world_size: int, store: Any, location: str, commit: str) -> dict[str, Any]:
    from tests.helpers.slime_source import RECORD, RolloutManager, install

    install(SlimeSource(Path(location), commit))
    _no_cuda_major_probe()
    module = sys.modules.setdefault("slime.ray.placement_group", type(sys)("slime.ray.placement_group"))
    module.__package__ = "slime.ray"
    exec(
        compile(SlimeSource(Path(location), commit).read("slime/ray/placement_group.py"), "<pg>", "exec"),
        vars(module),
    )
    actor_module = sys.modules["slime.backends.megatron_utils.actor"]
    original = actor_module.MegatronTrainRayActor
    out: dict[str, Any] = {"halves": launch.install(launch.SLIME, {"RL_LIFECYCLE_WRAP": "trainer"})}
    from slime.ray.placement_group import allocate_train_group

    placement = sys.modules["ray.util.placement_group"].PlacementGroup()
    args = slime_args(1, use_critic=True, use_routing_replay=False)
    # As create_training_models builds the critic: slime's own allocate_train_group, no actor_cls.
    critic = allocate_train_group(
        args=args, num_nodes=1, num_gpus_per_node=1, pg=(placement, [0], [0]), role="critic"
    )
    out["create"] = critic.create(rollout_manager=RolloutManager())
    actor = critic._actor_handlers[0].instance
    out["mro"] = [c.__name__ for c in type(actor).__mro__][:6]
    out["snapshot"] = {k: actor.lifecycle_state()[k] for k in ("state", "role")}
    out["hook_mode"] = actor.lifecycle.hooks.memory.hook_mode
    out["train"] = error_of(lambda: critic.async_train(0, rollout(0)))
    out["save"] = error_of(lambda: critic.save_model(0))
    out["after"] = actor.lifecycle_state()["state"]
    out["trained"] = len(RECORD["trained"])
    out["unwrapped"] = error_of(lambda: original(1, 0, "127.0.0.1", 12345))
    return out


def test_slimes_critic_built_without_actor_cls_runs_under_the_lifecycle(slime: SlimeSource) -> None:
    """slime's own allocate_train_group/RayTrainGroup resolve MegatronTrainRayActor by module and name:
    with the switch on, the critic is the lifecycle class, ends init asleep and stays so through a
    train and a save; slime's own class refuses to be created unwrapped."""
    (result,) = run_world(_slime_critic, 1, str(slime.location), slime.commit, deadline_s=240.0)
    no_crash([result])
    assert result["halves"] == ["trainer"]
    # Ray is played in this process: the class RayTrainGroup gets from slime's module is created as is.
    assert result["mro"] == [
        "LifecycleMegatronTrainRayActor",  # the job's class (`launch.job_class`)
        "JobLifecycle",
        "LifecycleMegatronTrainRayActor",
        "SlimeLifecycleMixin",
        "LifecycleMixin",
        "MegatronTrainRayActor",
    ]
    assert result["snapshot"] == {"state": "PAUSED", "role": "critic"}
    assert result["hook_mode"] == "preload"  # slime's launcher preloads torch_memory_saver for it
    assert result["train"] is None and result["save"] is None and result["after"] == "PAUSED"
    assert result["trained"] == 1
    assert result["unwrapped"].startswith(
        "UnwrappedClassError: slime: RL_LIFECYCLE_WRAP asks for the trainer"
    )


def _miles_actor(rank: int, world_size: int, store: Any, location: str, commit: str) -> dict[str, Any]:
    from tests.helpers.miles_source import install

    actor_module = install(MilesSource(Path(location), commit))
    out: dict[str, Any] = {"halves": launch.install(launch.MILES, {"RL_LIFECYCLE_WRAP": "trainer"})}
    cls = actor_module.MegatronTrainRayActor
    out["mro"] = [c.__name__ for c in cls.__mro__][:5]
    factory = sys.modules["miles.ray.train.actor_factory"]
    out["factory_resolves"] = (
        factory.__dict__.get("MegatronTrainRayActor") is None
    )  # imported inside the function
    return out


def test_miles_trainer_is_replaced_in_its_actor_module(miles: MilesSource) -> None:
    (result,) = run_world(_miles_actor, 1, str(miles.location), miles.commit, deadline_s=240.0)
    no_crash([result])
    assert result["mro"] == [
        "LifecycleMegatronTrainRayActor",  # the job's class (`launch.job_class`)
        "JobLifecycle",
        "LifecycleMegatronTrainRayActor",
        "MilesLifecycleMixin",
        "LifecycleMixin",
    ]
    assert result["factory_resolves"] is True
