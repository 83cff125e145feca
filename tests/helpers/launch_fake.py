"""A framework shaped as slime resolves its classes, for the launch switch's tests (tests only).

`write_framework(root, name)` writes a package `name` laid out as slime's job resolves its two halves:
the trainer class wrapped with `ray.remote` in the driver (`name.trainer.TrainActor`), and the engine
class read from the rollout module's globals inside a manager actor (`name.rollout.Group.start`), with
the engine defined elsewhere (`name.engine.Engine`), and a path that builds the engine from a name bound
before any patch (`name.engine.ORIGINAL`: a path the replacement does not reach). `launch_for(name)`
is the `FrameworkLaunch` for it; `hook` is a Ray setup hook installing it (the name from `FAKE_FRAMEWORK`).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from actor_integration.frameworks.launch import (
    SERVER_HOOKS,
    TRAINER_HOOKS,
    FrameworkLaunch,
    Replacement,
    install,
)
from actor_integration.tools.preflight import GIB, GPU, JobNeeds, Machine, Node

FRAMEWORK_ENV = "FAKE_FRAMEWORK"


class FakeLifecycle:
    """What the fake framework's classes run under (the slime and miles mixins' place)."""

    under_the_lifecycle = True


def wrap(original: type) -> type:
    return type(f"Lifecycle{original.__name__}", (FakeLifecycle, original), {"__module__": __name__})


def write_framework(root: Path, name: str) -> Path:
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "trainer.py").write_text(
        textwrap.dedent(
            """
            import os


            class TrainActor:
                def __init__(self, rank):
                    self.rank = rank

                def bases(self):
                    return [c.__name__ for c in type(self).__mro__]

                def environ(self, name):
                    return os.environ.get(name)
            """
        )
    )
    (package / "engine.py").write_text(
        textwrap.dedent(
            """
            import os


            class Engine:
                def __init__(self, args):
                    self.args = args

                def bases(self):
                    return [c.__name__ for c in type(self).__mro__]

                def environ(self, name):
                    return os.environ.get(name)


            ORIGINAL = Engine  # bound before the rollout module is patched: a path the replacement misses
            """
        )
    )
    (package / "rollout.py").write_text(
        textwrap.dedent(
            f"""
            import ray

            from {name}.engine import ORIGINAL, Engine


            def start_servers(args):
                return Engine(args)


            class Group:
                def start(self, args):
                    engine = ray.remote(num_cpus=0)(Engine).remote(args)
                    return ray.get(engine.bases.remote()), ray.get(engine.environ.remote("RL_LIFECYCLE_WRAP"))

                def start_elsewhere(self, args):
                    engine = ray.remote(num_cpus=0)(ORIGINAL).remote(args)
                    try:
                        return ray.get(engine.bases.remote())
                    except Exception as exc:
                        return str(exc)


            @ray.remote(num_cpus=0)
            class Manager:
                def __init__(self):
                    self.group = Group()

                def start(self, args):
                    return self.group.start(args)

                def start_elsewhere(self, args):
                    return self.group.start_elsewhere(args)
            """
        )
    )
    return package


def launch_for(name: str, *, machine: str = "tests.helpers.launch_fake:one_small_gpu") -> FrameworkLaunch:
    mixin = f"{__name__}:FakeLifecycle"
    return FrameworkLaunch(
        framework=name,
        commit="0000000",
        replacements=(
            Replacement(
                "trainer",
                f"{name}.trainer",
                "TrainActor",
                f"{name}.trainer",
                f"{__name__}:wrap",
                mixin,
                "actor",
                TRAINER_HOOKS,
            ),
            Replacement(
                "rollout",
                f"{name}.rollout",
                "Engine",
                f"{name}.engine",
                f"{__name__}:wrap",
                mixin,
                "engines",
                SERVER_HOOKS,
            ),
        ),
        preflight_at=f"{name}.rollout:start_servers",
        job_needs=f"{__name__}:job_needs",
        machine=machine,
    )


def job_needs(args: Any, *, framework: str) -> JobNeeds:
    """`args.gpus` GPUs of `args.gib` each for the trainer's state."""
    return JobNeeds(
        framework=framework,
        gpus=int(args["gpus"]),
        gpus_per_node=int(args["gpus"]),
        trainer_ranks=int(args["gpus"]),
        trainer_bytes_per_gpu=int(args.get("gib", 1) * GIB),
        cpus=1.0,
    )


def one_small_gpu() -> Machine:
    return Machine(nodes=(Node(name="here", gpus=(GPU(name="small", total_bytes=16 * GIB),), cpus=4.0),))


def hook() -> None:
    """Ray's setup hook for the fake framework named in `FAKE_FRAMEWORK`."""
    install(launch_for(os.environ[FRAMEWORK_ENV]))
