"""Suspend the NCCL communicators on sleep (ncclCommSuspend, NCCL 2.29.7+), resume them on wake.

Opt-in: it frees what the teardown frees but takes several times as long, because NCCL copies the
buffers' contents to pinned host memory (their allocation kind, `ncclMemOffload`, decides that; no
flag or variable skips it): docs/measurements.md#ncclcommsuspend-on-nccl-2307-2026-12-02.

ncclCommSuspend and ncclCommResume wait on the communicator's peers (a bootstrap barrier), so
every member rank must suspend the same communicators:

1. every rank posts the communicators it has (torch creates them at a group's first collective);
   a group with one on some members only is torn down instead, on all of them;
2. WORLD first: where it cannot be suspended on some rank, this whole sleep tears down instead;
3. the rest one after another in creation order, the same on every rank (torch's
   Backend.suspend may hold the GIL while it waits, so threads could wait on each other across
   ranks; threads were no faster on the H200 either: 4.3 s against 5.0 s);
4. every rank posts the groups that failed (NVLS communicators on Hopper, NCCL #2337; shared
   split resources); those go down on every member and are rebuilt on wake when they are ours.
"""

from __future__ import annotations

import json

import torch.distributed as dist
from torch.distributed import ProcessGroup

from actor_integration.backends.process_groups import _nccl, _teardown
from actor_integration.backends.process_groups._destroy import DestroyCommunicators
from actor_integration.backends.process_groups._way import DeviceMemory, Outcome, WayHost, measured
from lifecycle.table import ASLEEP, Communicators

WORLD = "WORLD"  # how the default group is named in the fallback reports


class SuspendCommunicators:
    """ncclCommSuspend on sleep, ncclCommResume on wake; a group that cannot be suspended is torn down."""

    name = Communicators.SUSPEND
    asleep = ASLEEP[name]

    def __init__(self) -> None:
        self.support: _nccl.NcclSuspendSupport | None = None
        self._suspended: list[tuple[ProcessGroup, _nccl.Communicator, int | None]] = []  # in suspend order
        self._hidden: dict[str, ProcessGroup | None] = {}  # the handles' groups, handed back on wake
        self._rebuild: list[str] = []  # handles whose groups fell back to a teardown
        self._whole: DestroyCommunicators | None = None  # WORLD could not be suspended: this sleep destroyed
        self.lost: tuple[str, ...] = ()  # others' groups (Megatron's) torn down: their owner rebuilds them

    def check(self, backend: str) -> None:
        support = _nccl.nccl_suspend_support(backend)
        if not support.available:
            raise ValueError(
                f"communicators='suspend' cannot work here: {support.reason}. The default, "
                "communicators='destroy', frees the same memory (and was faster on an H200: 0.73-0.80 s "
                "against 3.7-6.3 s)."
            )
        self.support = support

    # ------------------------------------------------------------------ sleep

    def release(self, host: WayHost) -> Outcome:
        self.lost = ()
        self._hidden.update(host.hide_handles(self.asleep))
        device = DeviceMemory(host.device)
        world = dist.distributed_c10d._get_default_group()
        nccl = [(pg, c) for pg in host.groups() if (c := _nccl.communicator_of(pg)) is not None]
        have = sorted(_name(pg, world) for pg, c in nccl if c.created())
        posted = host.gather("suspend plan", json.dumps(have))
        created = [set(json.loads(p)) for p in posted]
        fell_back: dict[str, str] = {}
        plan: list[tuple[ProcessGroup, _nccl.Communicator]] = []
        for pg, communicator in nccl:
            name = _name(pg, world)
            members = dist.get_process_group_ranks(pg)
            with_one = [r for r in members if name in created[r]]
            if len(with_one) == len(members):
                plan.append((pg, communicator))
            elif with_one:  # suspend would wait forever on the members without one
                fell_back[name] = (
                    f"a communicator on ranks {with_one} only, not on the other members {members}"
                )

        world_error = fell_back.get(WORLD, "")
        if plan and plan[0][0] is world:
            world_error = self._suspend_one(world, plan.pop(0)[1], fell_back) or ""
        verdicts = host.gather("suspend WORLD", world_error)
        failed = {rank: why for rank, why in enumerate(verdicts) if why}
        if failed:
            return self._destroy_instead(host, failed)

        for pg, communicator in plan:
            self._suspend_one(pg, communicator, fell_back)
        self._tear_down_fallbacks(host, world, fell_back)
        freed, by = measured(self._nccl_bytes(), device)
        labels = {_name(pg, world): _label(pg, world) for pg, _ in nccl}
        shown = {labels.get(name, name): why for name, why in fell_back.items()}
        return Outcome(self.name, len(self._suspended), freed, by, fell_back=shown)

    def _suspend_one(
        self, pg: ProcessGroup, communicator: _nccl.Communicator, fell_back: dict[str, str]
    ) -> str | None:
        """Suspend one communicator; on failure note why (the caller tears its group down) and return it."""
        try:
            stats = communicator.stats()
            communicator.suspend()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            fell_back[_name(pg, dist.distributed_c10d._get_default_group())] = why
            return why
        self._suspended.append((pg, communicator, None if stats is None else stats.suspendable))
        return None

    def _destroy_instead(self, host: WayHost, failed: dict[int, str]) -> Outcome:
        """WORLD could not be suspended somewhere: this whole sleep tears down, on every rank."""
        self._suspended = []
        host.show_handles(self._hidden)  # the teardown hides them again, as destroyed
        self._hidden = {}
        self._whole = DestroyCommunicators()
        outcome = self._whole.release(host)
        outcome.fell_back = {WORLD: "; ".join(f"rank {r}: {why}" for r, why in failed.items())}
        return outcome

    def _tear_down_fallbacks(self, host: WayHost, world: ProcessGroup, fell_back: dict[str, str]) -> None:
        """Every rank posts its failures; each group any member could not suspend goes down on all members."""
        mine = {
            "groups": sorted(fell_back),
            "handles": sorted(
                name
                for name, group in self._hidden.items()
                if isinstance(group, ProcessGroup) and _name(group, world) in fell_back
            ),
        }
        every = [json.loads(p) for p in host.gather("suspend failures", json.dumps(mine))]
        down = {name for p in every for name in p["groups"]}
        rebuilt = {name for p in every for name in p["handles"]}
        # The same list, in handle order, on every rank: recreating them is collective over WORLD.
        self._rebuild = [name for name in host.handle_names() if name in rebuilt]
        doomed = [pg for pg in host.groups() if pg is not world and _name(pg, world) in down]
        for pg in doomed:
            fell_back.setdefault(_name(pg, world), "torn down with its peers, which could not suspend it")
        self._suspended = [entry for entry in self._suspended if all(entry[0] is not pg for pg in doomed)]
        ours = {id(group) for group in self._hidden.values() if isinstance(group, ProcessGroup)}
        self.lost = tuple(_label(pg, world) for pg in doomed if id(pg) not in ours)
        for name in self._rebuild:
            self._hidden.pop(name, None)
        _teardown.each_at_once(dist.destroy_process_group, doomed)

    def _nccl_bytes(self) -> int | None:
        counted = [freed for _, _, freed in self._suspended]
        return None if any(c is None for c in counted) else sum(c for c in counted if c is not None)

    # ------------------------------------------------------------------ wake

    def restore(self, host: WayHost) -> Outcome:
        if self._whole is not None:
            outcome = self._whole.restore(host)
            self._whole = None
            return outcome
        device = DeviceMemory(host.device)
        resumed = self._nccl_bytes()
        count = len(self._suspended)
        while self._suspended:  # in suspend order (WORLD first), the same on every rank
            _, communicator, _ = self._suspended[0]
            communicator.resume()
            self._suspended.pop(0)  # a retry after a failure resumes only the rest
        host.show_handles(self._hidden)
        self._hidden = {}
        rebuilt, self._rebuild = self._rebuild, []
        host.recreate(rebuilt)  # collective on every rank: every rank has the same list
        taken, by = measured(resumed, device, taken=True)
        return Outcome(self.name, count + len(rebuilt), taken, by)

    def close(self, host: WayHost) -> None:
        # A suspended communicator is resumed before torch destroys it: NCCL's teardown expects
        # its buffers mapped. Resume waits on the peers: close() on every rank.
        while self._suspended:
            _, communicator, _ = self._suspended.pop(0)
            try:
                communicator.resume()
            except Exception:  # closing anyway: the teardown that follows frees what it can
                continue
        self._hidden, self._rebuild, self._whole = {}, [], None


def _name(pg: ProcessGroup, world: ProcessGroup) -> str:
    """A group's name, the same on every rank (torch numbers groups in creation order)."""
    return WORLD if pg is world else str(pg.group_name)


def _label(pg: ProcessGroup, world: ProcessGroup) -> str:
    """How a group is shown: its description (a handle's name, Megatron's) where it has one."""
    desc = "" if pg is world else str(getattr(pg, "group_desc", "") or "")
    return desc if desc and desc != "undefined" else _name(pg, world)
