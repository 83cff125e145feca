"""A slime or miles job under the lifecycle, switched on where the job is launched, no edit of its source.

slime's scripts start a job with `ray start --head`, then `ray job submit --runtime-env-json '{...}'
-- python3 train.py ...`; the one change is a key in that JSON (and, optionally, a variable):

    ray job submit --address="http://127.0.0.1:8265" --runtime-env-json='{
        "worker_process_setup_hook": "actor_integration.frameworks.launch.slime",
        "env_vars": {"PYTHONPATH": "/root/Megatron-LM/", "RL_LIFECYCLE_WRAP": "trainer,rollout"}
    }' -- python3 train.py ...          # miles: "actor_integration.frameworks.launch.miles"

Why Ray's setup hook: the driver cannot be reached without editing `train.py` (and calling
`ray.init()` there raises "ray.init twice": `create_placement_groups` has already started Ray
through its auto-init, and slime's debug guide warns against `ray.init()` under `ray job submit`).
The classes the job runs are not resolved in the driver anyway. Ray runs the hook in every worker of
the job before any of its tasks or actors, actors created inside actors and actors with
`runtime_env`s of their own included (the job's `env_vars` reach them too), and never in the driver.

Where each class is resolved, and so where it is replaced (read from slime 624b824a, miles 31f1ca96):

| class | the driver | the worker that runs it |
|---|---|---|
| `MegatronTrainRayActor` (actor and critic: `create_training_models` builds the critic without `actor_cls`) | `RayTrainGroup` wraps it with `ray.remote`; Ray pickles the class it makes by value, its base by module and name | unpickling looks the base up in `slime.backends.megatron_utils.actor`, replaced there when that module is imported |
| `SGLangEngine` | not at all | the rollout manager's worker: `ServerGroup.start_engines` reads `slime.ray.rollout.SGLangEngine` (miles: `miles.ray.rollout.server_group`), replaced there |

The replacement happens when the module is imported in a worker (a post-import patch), so workers
that never import slime (Ray's job supervisor, the placement-group probes) load nothing of it. Each
replacement is logged in the worker that makes it (Ray forwards it to the job's output). Asked for a
half, the job never runs it silently unwrapped: the framework's own class is guarded in every worker
(`UnwrappedClassError` when an actor of it is created outside the lifecycle, e.g. a custom
`actor_cls`), a framework whose module or class is not where the adapter reads it is refused
(`LaunchConfigError`), and so is a value of `RL_LIFECYCLE_WRAP` other than `trainer`, `rollout`,
or both (unset: both). Before the rollout manager starts any engine, the job's needs are checked
against the cluster (`actor_integration.tools.preflight`; `RL_LIFECYCLE_PREFLIGHT=warn` reports
without refusing, `off` skips it).

Failures inside the job. The job's driver is the framework's: it neither recovers a FAILED actor nor
reads its state, so a hook that raises fails the call with `LifecycleFailedError` (the hook's error
its cause) naming the actor's role and rank, the transition and what is resident, and the job
stops on it. A rollout engine whose server dies (its scheduler killed) ends the rollout with
`EngineDiedError` within about a second, naming the engine and the process (slime: see
`frameworks.slime.rollout.watch_rollouts`); what is left of that server is killed.

Testing and staging only: `RL_LIFECYCLE_FAULT=[trainer:|rollout:]HOOK@N` (the grammar of `lifecycle
demo --inject-fault`, `lifecycle.faults.parse_fault`; role trainer when left out) makes the N-th
call of HOOK raise `InjectedFault` in every actor of that half, each counting its own calls:
`trainer:memory.pause@2` fails the sleep that ends each trainer's first train (slime's init sleep
is the first pause). A value that does not parse, a half the job does not wrap, or a hook that
half never calls is refused (`LaunchConfigError`) before any actor runs. Never set it in production.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, cast

from actor_integration.errors import LaunchConfigError, UnwrappedClassError
from actor_integration.frameworks.job_output import say
from lifecycle.faults import Fault, FaultInjector, parse_fault, with_faults
from lifecycle.table import Hook

__all__ = [
    "BUDGET_VARIABLE",
    "CHECK_WEIGHTS_VARIABLE",
    "FAULT_VARIABLE",
    "HALVES",
    "MILES",
    "PREFLIGHT_VARIABLE",
    "SERVER_HOOKS",
    "SLIME",
    "TRAINER_HOOKS",
    "WRAP_VARIABLE",
    "FrameworkLaunch",
    "JobLifecycle",
    "Replacement",
    "install",
    "job_class",
    "lifecycle_class",
    "miles",
    "parse_fault_variable",
    "parse_wrap",
    "replaced",
    "say",
    "slime",
]

WRAP_VARIABLE = "RL_LIFECYCLE_WRAP"
FAULT_VARIABLE = "RL_LIFECYCLE_FAULT"
PREFLIGHT_VARIABLE = "RL_LIFECYCLE_PREFLIGHT"
BUDGET_VARIABLE = "RL_LIFECYCLE_MEMORY_BUDGET"  # read by the framework's trainer adapter (`memory_budget`)
# read by the framework's trainer adapter (`weights_check`)
CHECK_WEIGHTS_VARIABLE = "RL_LIFECYCLE_CHECK_WEIGHTS"
HALVES = ("trainer", "rollout")
PREFLIGHT_MODES = ("error", "warn", "off")


@dataclass(frozen=True)
class Replacement:
    """One class a framework's job resolves by module and name, and what the lifecycle puts there.

    `module`.`name` is where the framework reads the class; `defined_in` where the class itself is
    defined (its original is guarded there); `wrap(original)` builds the lifecycle class; `mixin`
    (as "module:Class") is what every instance of the half must be; `runs` names the roles it plays;
    `hooks` the hooks its machine may call (what `RL_LIFECYCLE_FAULT` may name for the half).
    """

    half: str
    module: str
    name: str
    defined_in: str
    wrap: str  # "module:function" taking the original class, returning the lifecycle class
    mixin: str
    runs: str
    hooks: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrameworkLaunch:
    """A framework's classes under the lifecycle, where its rollout manager starts the engines
    (`preflight_at`, "module:function", run after the preflight), and what watches the engines
    during a rollout when the rollout half is wrapped (`engine_watch`: (module, "module:function"
    patching it when it is imported) pairs)."""

    framework: str
    commit: str
    replacements: tuple[Replacement, ...]
    preflight_at: str | None = None
    engine_watch: tuple[tuple[str, str], ...] = ()
    job_needs: str | None = None  # "module:function" (args, framework=) -> JobNeeds, for the preflight
    # "module:function" (environ, args=None) -> str | None: the trainer's RL_LIFECYCLE_MEMORY_BUDGET checked at
    # install (its value) and where the preflight runs (the job's flags); None: the framework's trainer has none
    memory_budget: str | None = None
    # the same for RL_LIFECYCLE_CHECK_WEIGHTS (the trainer's check of every weight update); None: none
    weights_check: str | None = None
    machine: str = "actor_integration.tools.preflight:describe_ray_cluster"  # "module:function" () -> Machine

    def halves(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.half for r in self.replacements))

    def trainer_settings(self) -> tuple[tuple[str, str | None, str, str], ...]:
        """The trainer adapter's opt-in settings: (variable, its checker or None, its name, what a
        framework without it does instead), read at install and where the preflight runs."""
        return (
            (BUDGET_VARIABLE, self.memory_budget, "memory budget", "its every sleep releases everything"),
            (CHECK_WEIGHTS_VARIABLE, self.weights_check, "weights check", "its pushes go unchecked"),
        )


# The hooks each half's machine may call: a trainer's (routing replay only with slime's flag), and an
# engine server's (memory by tag, generation around its sleep).
TRAINER_HOOKS = tuple(
    h.value for h in Hook if h not in (Hook.GENERATION_PAUSE, Hook.GENERATION_RESUME, Hook.BUDGET_CHECK)
)
SERVER_HOOKS = tuple(
    h.value for h in (Hook.GENERATION_PAUSE, Hook.MEMORY_PAUSE, Hook.MEMORY_RESUME, Hook.GENERATION_RESUME)
)

SLIME = FrameworkLaunch(
    framework="slime",
    commit="624b824a",
    replacements=(
        Replacement(
            half="trainer",
            module="slime.backends.megatron_utils.actor",
            name="MegatronTrainRayActor",
            defined_in="slime.backends.megatron_utils.actor",
            wrap="actor_integration.frameworks.launch:slime_trainer",
            mixin="actor_integration.frameworks.slime:SlimeLifecycleMixin",
            runs="actor and critic",
            hooks=TRAINER_HOOKS,
        ),
        Replacement(
            half="rollout",
            module="slime.ray.rollout",
            name="SGLangEngine",
            defined_in="slime.backends.sglang_utils.sglang_engine",
            wrap="actor_integration.frameworks.slime.rollout:lifecycle_engine",
            mixin="actor_integration.engines.sglang.actor:SGLangActorLifecycle",
            runs="rollout engines",
            hooks=SERVER_HOOKS,
        ),
    ),
    preflight_at="slime.ray.rollout:start_rollout_servers",
    engine_watch=(
        ("slime.ray.rollout", "actor_integration.frameworks.slime.rollout:record_servers"),
        ("slime.rollout.base_types", "actor_integration.frameworks.slime.rollout:watch_rollouts"),
    ),
    job_needs="actor_integration.tools.preflight:slime_job_needs",
    memory_budget="actor_integration.frameworks.slime.budget:check_budget",
    weights_check="actor_integration.frameworks.slime.weights_check:check_setting",
)

MILES = FrameworkLaunch(
    framework="miles",
    commit="31f1ca96",
    replacements=(
        Replacement(
            half="trainer",
            module="miles.backends.megatron_utils.actor",
            name="MegatronTrainRayActor",
            defined_in="miles.backends.megatron_utils.actor",
            wrap="actor_integration.frameworks.launch:miles_trainer",
            mixin="actor_integration.frameworks.miles:MilesLifecycleMixin",
            runs="actor and critic, train.py and train_async.py",
            hooks=TRAINER_HOOKS,
        ),
        Replacement(
            half="rollout",
            module="miles.ray.rollout.server_group",
            name="SGLangEngine",
            defined_in="miles.backends.sglang_utils.sglang_engine",
            wrap="actor_integration.frameworks.miles.rollout:lifecycle_engine",
            mixin="actor_integration.engines.sglang.actor:SGLangActorLifecycle",
            runs="rollout engines",
            hooks=SERVER_HOOKS,
        ),
    ),
    preflight_at="miles.ray.rollout.rollout_server:start_rollout_servers",
    job_needs="actor_integration.tools.preflight:slime_job_needs",  # miles keeps slime's flags for these
)


# ---------------------------------------------------------------------------------------------- the hooks


def slime() -> None:
    """Ray's `worker_process_setup_hook` for a slime job: see the module's doc."""
    install(SLIME)


def miles() -> None:
    """Ray's `worker_process_setup_hook` for a miles job (`train.py` and `train_async.py`)."""
    install(MILES)


def parse_wrap(value: str | None, launch: FrameworkLaunch = SLIME) -> tuple[str, ...]:
    """The halves `RL_LIFECYCLE_WRAP` asks for (unset or empty: both), in a fixed order."""
    if value is None or not value.strip():
        return launch.halves()
    asked = [token.strip().lower() for token in value.split(",") if token.strip()]
    unknown = [token for token in asked if token not in HALVES]
    if unknown:
        hint = ""
        if {"actor", "critic"} & set(unknown):
            hint = (
                f" ({launch.framework} builds the actor and the critic from one class, MegatronTrainRayActor: "
                "'trainer' puts both under the lifecycle)"
            )
        raise LaunchConfigError(
            f"{WRAP_VARIABLE}={value!r}: {', '.join(map(repr, unknown))} is not a half of the job{hint}; "
            f"use 'trainer', 'rollout' or 'trainer,rollout' (unset: both)",
            framework=launch.framework,
            variable=WRAP_VARIABLE,
        )
    return tuple(half for half in HALVES if half in asked)


def parse_fault_variable(
    value: str | None, launch: FrameworkLaunch = SLIME, halves: Sequence[str] | None = None
) -> Fault | None:
    """The fault `RL_LIFECYCLE_FAULT` arms (unset or empty: none), checked against the halves the
    job wraps (`halves`; None: all of the framework's) and the hooks each half's machine calls."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        fault = parse_fault(text)
    except ValueError as exc:
        raise LaunchConfigError(
            f"{FAULT_VARIABLE}={exc} (a testing switch: leave it unset in production)",
            framework=launch.framework,
            variable=FAULT_VARIABLE,
        ) from None
    wrapped = launch.halves() if halves is None else tuple(halves)
    if fault.role not in wrapped:
        raise LaunchConfigError(
            f"{FAULT_VARIABLE}={text!r}: the {fault.role} half is not under the lifecycle in this job "
            f"({WRAP_VARIABLE}={','.join(wrapped)}); a fault goes to a wrapped half's hooks",
            framework=launch.framework,
            variable=FAULT_VARIABLE,
        )
    called = next(r.hooks for r in launch.replacements if r.half == fault.role)
    if fault.hook not in called:
        raise LaunchConfigError(
            f"{FAULT_VARIABLE}={text!r}: {launch.framework}'s {fault.role} never calls {fault.hook}; its "
            f"machine's hooks are {list(called)}",
            framework=launch.framework,
            variable=FAULT_VARIABLE,
        )
    return fault


def install(launch: FrameworkLaunch, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Put the halves the environment asks for under the lifecycle in this process, as each module
    is imported (or now, if it is already). Idempotent. Returns the halves."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    halves = parse_wrap(env.get(WRAP_VARIABLE), launch)
    mode = (env.get(PREFLIGHT_VARIABLE) or "error").strip().lower()
    if mode not in PREFLIGHT_MODES:
        raise LaunchConfigError(
            f"{PREFLIGHT_VARIABLE}={env.get(PREFLIGHT_VARIABLE)!r}: use one of {list(PREFLIGHT_MODES)} (unset: error)",
            framework=launch.framework,
            variable=PREFLIGHT_VARIABLE,
        )
    fault = parse_fault_variable(env.get(FAULT_VARIABLE), launch, halves)
    settings = _trainer_settings(launch, halves, env)
    chosen = [r for r in launch.replacements if r.half in halves]
    _require_modules(launch, chosen)
    with _LOCK:
        if (launch.framework, halves, fault) in _INSTALLED:
            return halves
        _INSTALLED.add((launch.framework, halves, fault))
        for replacement in chosen:
            armed = fault if fault is not None and fault.role == replacement.half else None
            _FINDER.after_import(replacement.defined_in, functools.partial(_guard, launch, replacement))
            _FINDER.after_import(replacement.module, functools.partial(_replace, launch, replacement, armed))
        if launch.preflight_at is not None and (mode != "off" or settings):
            module, _, function = launch.preflight_at.partition(":")
            _FINDER.after_import(module, functools.partial(_preflight_first, launch, function, mode, env))
        for module, watch in launch.engine_watch if "rollout" in halves else ():
            _FINDER.after_import(module, functools.partial(_patch, watch))
    say(
        f"{launch.framework} job: {WRAP_VARIABLE}={','.join(halves)}: "
        + "; ".join(f"{r.name} ({r.runs}) from {r.module}" for r in chosen)
        + " under the lifecycle"
        + "".join(f"; {line}" for line in settings)
        + (
            f"; {FAULT_VARIABLE}={fault.role}:{fault.hook}@{fault.step}: call {fault.step} of {fault.hook} "
            f"raises in every {fault.role} actor (testing only)"
            if fault is not None
            else ""
        )
    )
    return halves


def replaced() -> dict[str, str]:
    """What this process replaced so far: "module.Name" → the lifecycle class's name."""
    with _LOCK:
        return dict(_REPLACED)


# ---------------------------------------------------------------------------------------------- classes


_BUILT: dict[tuple[type, type], type] = {}


def lifecycle_class(mixin: type, original: type, module: str = __name__) -> type:
    """`class Lifecycle<Name>(mixin, original)`, built once per pair (Ray pickles it by value);
    `module` is where it says it comes from."""
    built = _BUILT.get((mixin, original))
    if built is None:
        built = type(f"Lifecycle{original.__name__}", (mixin, original), {"__module__": module})
        _BUILT[(mixin, original)] = built
    return built


def slime_trainer(original: type) -> type:
    """`class LifecycleMegatronTrainRayActor(SlimeLifecycleMixin, MegatronTrainRayActor)`, once."""
    from actor_integration.frameworks.slime import SlimeLifecycleMixin

    return lifecycle_class(SlimeLifecycleMixin, original)


def miles_trainer(original: type) -> type:
    """`class LifecycleMegatronTrainRayActor(MilesLifecycleMixin, MegatronTrainRayActor)`, once."""
    from actor_integration.frameworks.miles import MilesLifecycleMixin

    return lifecycle_class(MilesLifecycleMixin, original)


def _patch(spec: str, module: ModuleType) -> None:
    _resolve(spec)(module)


def _resolve(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class JobLifecycle:
    """What the launch switch adds to every class it puts under the lifecycle (first in the bases).

    The job's driver is the framework's: it neither recovers a FAILED actor nor reads its state, so
    the machine's `typed_failures` is set: a hook that raises fails the call with
    `LifecycleFailedError` naming the rank, the transition and what is resident. `lifecycle_fault`
    (from `RL_LIFECYCLE_FAULT`, testing only) is armed on the machine's hooks: the fault's N-th
    call of its hook raises `InjectedFault` (`lifecycle_faults` is the injector).
    """

    lifecycle_fault: ClassVar[Fault | None] = None

    def configure_lifecycle(self, policy: Any, hooks: Any, **kwargs: Any) -> Any:
        fault = self.lifecycle_fault
        if fault is not None:
            injector = FaultInjector()
            injector.arm(fault.hook, at=fault.step)
            self.lifecycle_faults = injector
            hooks = with_faults(injector, hooks)
        lifecycle = cast(Any, super()).configure_lifecycle(policy, hooks, **kwargs)
        lifecycle.typed_failures = True
        return lifecycle


_JOB_CLASSES: dict[tuple[type, Fault | None], type] = {}


def job_class(wrapped: type, fault: Fault | None = None) -> type:
    """`wrapped` (a lifecycle class) as the job runs it: `JobLifecycle` first, `fault` armed; its
    name and module are `wrapped`'s. Built once per pair."""
    built = _JOB_CLASSES.get((wrapped, fault))
    if built is None:
        namespace = {
            "__module__": wrapped.__module__,
            "__qualname__": wrapped.__qualname__,
            "lifecycle_fault": fault,
        }
        built = type(wrapped.__name__, (JobLifecycle, wrapped), namespace)
        _JOB_CLASSES[(wrapped, fault)] = built
    return built


def _replace(
    launch: FrameworkLaunch, replacement: Replacement, fault: Fault | None, module: ModuleType
) -> None:
    original = _class_in(launch, replacement, module, replacement.module)
    mixin = _resolve(replacement.mixin)
    where = f"{replacement.module}.{replacement.name}"
    if issubclass(original, mixin):
        return  # replaced already (or the user's own lifecycle class): left as it is
    wrapped = job_class(_resolve(replacement.wrap)(original), fault)
    setattr(module, replacement.name, wrapped)
    _guard(launch, replacement, None, original=original)
    with _LOCK:
        _REPLACED[where] = wrapped.__name__
    say(
        f"{launch.framework}: {where} ({replacement.runs}) runs as {wrapped.__name__} "
        f"({mixin.__name__}) in this process (pid {os.getpid()})"
        + (f", {FAULT_VARIABLE} armed: call {fault.step} of {fault.hook} raises" if fault is not None else "")
    )


def _guard(
    launch: FrameworkLaunch,
    replacement: Replacement,
    module: ModuleType | None,
    *,
    original: type | None = None,
) -> None:
    """The framework's own class refuses to be created outside the lifecycle (in this process)."""
    if original is None:
        assert module is not None
        original = _class_in(launch, replacement, module, replacement.defined_in)
    if original.__dict__.get("_rl_lifecycle_guarded"):
        return
    mixin = _resolve(replacement.mixin)
    if issubclass(original, mixin):
        return
    own_init = original.__dict__.get("__init__")
    base: type = original

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(self, mixin):
            raise UnwrappedClassError(
                f"{launch.framework}: {WRAP_VARIABLE} asks for the {replacement.half} under the lifecycle, but this "
                f"process creates {type(self).__module__}.{type(self).__qualname__}, a {base.__name__} without "
                f"{mixin.__name__}: it would run unwrapped. Let the launch switch build it (no actor_cls of your "
                f"own), derive your class from {mixin.__name__}, or leave '{replacement.half}' out of {WRAP_VARIABLE}",
                framework=launch.framework,
                half=replacement.half,
                created=f"{type(self).__module__}.{type(self).__qualname__}",
            )
        if own_init is not None:
            own_init(self, *args, **kwargs)
        else:
            super(base, self).__init__(*args, **kwargs)  # type: ignore[arg-type]  # mypy wants a class literal

    __init__.__qualname__ = f"{original.__qualname__}.__init__"
    if own_init is not None:
        functools.update_wrapper(__init__, own_init)
    type.__setattr__(original, "__init__", __init__)
    type.__setattr__(original, "_rl_lifecycle_guarded", True)


def _class_in(launch: FrameworkLaunch, replacement: Replacement, module: ModuleType, where: str) -> type:
    found = getattr(module, replacement.name, None)
    if not isinstance(found, type):
        raise LaunchConfigError(
            f"{launch.framework}: {where} has no class {replacement.name}, where the lifecycle's launch switch "
            f"reads the {replacement.half} ({launch.framework} {launch.commit}); this {launch.framework} builds it "
            f"elsewhere: update rl-lifecycle, or leave '{replacement.half}' out of {WRAP_VARIABLE}",
            framework=launch.framework,
            module=where,
        )
    return found


def _require_modules(launch: FrameworkLaunch, chosen: Sequence[Replacement]) -> None:
    """Refuse, before any actor runs, a framework whose modules are not where the adapter reads them
    (located without importing them: only the top package's directory is looked up)."""
    try:
        spec = importlib.util.find_spec(launch.framework)
    except (
        ValueError
    ):  # imported already, with no spec (a package assembled in memory): its layout is its own
        return
    if spec is None or not spec.submodule_search_locations:
        raise LaunchConfigError(
            f"{launch.framework} is not importable in this Ray worker (pid {os.getpid()}), so its job cannot "
            f"be put under the lifecycle: install {launch.framework}, or put it on the job's PYTHONPATH "
            "(runtime env env_vars)",
            framework=launch.framework,
        )
    roots = [Path(p) for p in spec.submodule_search_locations]
    wanted = {r.module for r in chosen} | {r.defined_in for r in chosen}
    if launch.preflight_at is not None:
        wanted.add(launch.preflight_at.partition(":")[0])
    if any(r.half == "rollout" for r in chosen):
        wanted |= {module for module, _ in launch.engine_watch}
    for module in sorted(wanted):
        parts = module.split(".")[1:]
        if not any(_module_file(root, parts) for root in roots):
            raise LaunchConfigError(
                f"{launch.framework}: no module {module} in {[str(r) for r in roots]}, where the lifecycle's "
                f"launch switch reads the job's classes ({launch.framework} {launch.commit}): this "
                f"{launch.framework} is laid out differently; update rl-lifecycle",
                framework=launch.framework,
                module=module,
            )


def _module_file(root: Path, parts: list[str]) -> bool:
    path = root.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


# ---------------------------------------------------------------------------------------------- preflight


def _trainer_settings(launch: FrameworkLaunch, halves: tuple[str, ...], env: Mapping[str, str]) -> list[str]:
    """The trainer adapter's settings the job sets (`RL_LIFECYCLE_MEMORY_BUDGET`, `RL_LIFECYCLE_CHECK_WEIGHTS`),
    each checked, refused where nothing would read it (never ignored in silence): a line for each that is on."""
    lines = []
    for variable, checker, what, instead in launch.trainer_settings():
        value = (env.get(variable) or "").strip()
        if not value or value.lower() == "off":
            continue
        if checker is None:
            raise LaunchConfigError(
                f"{variable}={value!r}: {launch.framework}'s trainer adapter has no {what} (slime's has); "
                f"{instead}. Unset {variable}",
                framework=launch.framework,
                variable=variable,
            )
        if "trainer" not in halves:
            raise LaunchConfigError(
                f"{variable}={value!r} is read by the wrapped trainer, and {WRAP_VARIABLE}={','.join(halves)} leaves "
                f"the trainer {launch.framework}'s own: add 'trainer' to {WRAP_VARIABLE} or unset {variable}",
                framework=launch.framework,
                variable=variable,
            )
        line = _resolve(checker)(env)
        if line is not None:
            lines.append(cast("str", line))
    return lines


def _preflight_first(
    launch: FrameworkLaunch, function: str, mode: str, env: Mapping[str, str], module: ModuleType
) -> None:
    """`module.function(args, ...)` (where the rollout manager starts the engines, before the trainers are
    created) runs the preflight first (unless `mode` is off), and the trainer settings' checks of the flags."""
    original = getattr(module, function, None)
    if not callable(original) or getattr(original, "_rl_lifecycle_preflight", False):
        return

    @functools.wraps(original)
    def checked(args: Any, *rest: Any, **kwargs: Any) -> Any:
        from actor_integration.tools.preflight import check_job

        for _, checker, what, _ in launch.trainer_settings():
            line = _resolve(checker)(env, args) if checker is not None else None
            if line is not None:
                say(f"{launch.framework} {what}: {line}")
        needs = (
            _resolve(launch.job_needs)(args, framework=launch.framework)
            if launch.job_needs and mode != "off"
            else None
        )
        if needs is not None:
            report = check_job(_resolve(launch.machine)(), needs, refuse=mode == "error")
            say(f"{launch.framework} preflight: {report}")
        return original(args, *rest, **kwargs)

    checked._rl_lifecycle_preflight = True  # type: ignore[attr-defined]
    setattr(module, function, checked)


# ---------------------------------------------------------------------------------------------- imports


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks on a module right after it is executed, in whichever process imports it."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[ModuleType], None]]] = {}

    def after_import(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        module = sys.modules.get(name)
        if module is not None and not _initialising(module):
            callback(module)  # imported already: now
            return
        self.pending.setdefault(name, []).append(callback)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self, fullname)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _AfterImport, name: str) -> None:
        self.loader, self.finder, self.name = loader, finder, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self.loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader (tracebacks, inspect.getsource read through it).
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for callback in self.finder.pending.pop(self.name, []):
            callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _initialising(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


_LOCK = threading.RLock()
_FINDER = _AfterImport()
_INSTALLED: set[tuple[str, tuple[str, ...], Fault | None]] = set()
_REPLACED: dict[str, str] = {}
