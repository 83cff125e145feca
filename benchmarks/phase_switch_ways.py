"""bench_phase_switch.py's sections that run in processes of their own, beside the columns: the
teardown/rebuild section (torch's serial destroy vs ours) and the ways of treating the
communicators on sleep (destroy, suspend, keep)."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks.phase_switch_common import (
    GIB,
    WAY_CYCLES,
    Config,
    new_store,
    run_spawned,
    timed,
    used_gib,
    warm_groups,
)

# ---------------------------------------------------------------------------------------------- teardown


def teardown_main(cfg: Config, out: str) -> None:
    """WORLD + 16 subgroups, each warmed: torch's serial destroy vs ours; rebuilt lazily vs connect()."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore

    import lifecycle
    from actor_integration.backends.process_groups import ReloadableProcessGroups

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    result: dict[str, Any] = {}
    try:
        if cfg.gpu:
            torch.cuda.set_device(0)
        base = used_gib()
        # torch's own teardown: WORLD + 16 subgroups, one communicator after another.
        store = new_store()
        dist.init_process_group(cfg.backend, store=PrefixStore("serial", store), rank=0, world_size=1)
        for _ in range(16):
            dist.new_group([0])
        warm_groups()
        awake = used_gib()
        result["serial_destroy_s"] = timed(dist.destroy_process_group)
        result["serial_freed_gib"] = None if awake is None else round(awake - (used_gib() or 0.0), 2)
        # ours: the same groups (and the gloo side channel) through ReloadableProcessGroups.
        groups = ReloadableProcessGroups.init(
            backend=cfg.backend, rank=0, world_size=1, store=new_store(), timeout=timedelta(seconds=300)
        )
        for i in range(16):
            groups.new_group([0], name=f"g{i}")
        warm_groups()
        awake = used_gib()
        for i in range(2):
            result[f"concurrent_destroy_{i}_s"] = timed(groups.destroy)
            result[f"concurrent_freed_{i}_gib"] = (
                None if awake is None else round(awake - (used_gib() or 0.0), 2)
            )
            result[f"reload_{i}_s"] = timed(groups.reload)
            if i == 0:  # each communicator created by its group's first collective, one by one
                result["lazy_first_collectives_s"] = timed(warm_groups)
            else:  # every communicator created at once, then the same collectives
                result["connect_s"] = timed(groups.connect)
                result["after_connect_collectives_s"] = timed(warm_groups)
        result["base_used_gib"] = base
        groups.close()
    except BaseException as exc:
        result["error"] = f"{exc!r}\n{traceback.format_exc()}"
    Path(out).write_text(json.dumps(result, default=str))
    os._exit(0)


def run_teardown(cfg: Config) -> dict[str, Any]:
    return run_spawned(teardown_main, (cfg,), cfg.timeout_s, {})


# ---------------------------------------------------------------------------------------------- ways


def way_main(cfg: Config, way: str, out: str) -> None:
    """One way of treating the communicators on WORLD + 16 warmed subgroups, in a process of its own."""
    import lifecycle
    from actor_integration.backends.process_groups import ReloadableProcessGroups
    from lifecycle.logs import Event

    lifecycle.configure_logging(stream=open(os.devnull, "w"), level="warning")  # noqa: SIM115
    result: dict[str, Any] = {"way": way, "cycles": []}
    try:
        if cfg.gpu:
            torch.cuda.set_device(0)
        groups = ReloadableProcessGroups.init(
            backend=cfg.backend,
            rank=0,
            world_size=1,
            store=new_store(),
            timeout=timedelta(seconds=300),
            communicators=way,
        )
        for i in range(16):
            groups.new_group([0], name=f"g{i}")
        result["first_collectives_s"] = timed(warm_groups)
        with lifecycle.capture_events("debug") as events:
            for _ in range(WAY_CYCLES):
                awake = used_gib()
                mark = len(events)
                free_s = timed(groups.destroy)
                asleep = used_gib()
                back_s = timed(groups.reload)
                after_s = timed(warm_groups)
                destroyed = next(e for e in events[mark:] if e.get("event") == Event.GROUPS_DESTROYED)
                result["cycles"].append(
                    {
                        "free_s": free_s,
                        "freed_gib": None if awake is None or asleep is None else round(awake - asleep, 2),
                        "nccl_freed_gib": None
                        if destroyed.get("bytes") is None
                        else destroyed["bytes"] / GIB,
                        "measured_by": destroyed.get("measured_by"),
                        "held_gib": None
                        if destroyed.get("held_bytes") is None
                        else destroyed["held_bytes"] / GIB,
                        "fell_back": destroyed.get("fell_back"),
                        "back_s": back_s,
                        "first_collectives_s": after_s,
                        "used_awake_gib": awake,
                    }
                )
        groups.close()
    except BaseException as exc:
        result["error"] = f"{exc!r}\n{traceback.format_exc()}"
    Path(out).write_text(json.dumps(result, default=str))
    os._exit(0)


def run_way(cfg: Config, way: str) -> dict[str, Any]:
    return run_spawned(way_main, (cfg, way), cfg.timeout_s, {"way": way})


def suspend_unreachable(cfg: Config) -> str | None:
    """Why communicators="suspend" cannot run here (the children inherit this process's NCCL), or None."""
    from actor_integration.backends.process_groups import nccl_suspend_support

    support = nccl_suspend_support(cfg.backend)
    return None if support.available else support.reason
