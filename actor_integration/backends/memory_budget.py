"""The memory budget's probe on a real device: free memory from CUDA, inputs agreed over a store.

    probe = DeviceMemoryProbe(expected_bytes=memory.expected_bytes, store=store, rank=rank, world_size=n)
    hooks = Hooks(memory=memory, process_groups=groups, budget=probe)
    policy = LifecyclePolicy(..., memory_budget=MemoryBudget())

Ranks agree through the torch.distributed store (a `TCPStore`, the one `ReloadableProcessGroups`
meets on), not a collective: the groups are what a sleep may destroy, and the agreement must work
whatever the plan. Each rank posts its inputs, waits for every rank's, and every rank reduces the
same list (`lifecycle.budget.agree`), so their plans are equal by construction.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from actor_integration.backends.release_audit import cuda_free_bytes
from actor_integration.errors import RendezvousTimeoutError
from lifecycle.budget import BudgetInputs, agree

__all__ = ["DefaultStore", "DeviceMemoryProbe"]


class DeviceMemoryProbe:
    """A `lifecycle.MemoryProbe`: `free_bytes()` of this process's CUDA device (None where CUDA is not
    initialised), `expected_bytes(tag)` where given, and `agree()` over `world_size` ranks of `store`."""

    def __init__(
        self,
        *,
        free_bytes: Callable[[], int | None] = cuda_free_bytes,
        expected_bytes: Callable[[str | None], int | None] | None = None,
        store: Any = None,
        rank: int = 0,
        world_size: int = 1,
        prefix: str = "lifecycle/budget",
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        if world_size > 1 and store is None:
            raise ValueError(
                f"DeviceMemoryProbe: world_size={world_size} needs a store to agree on (the groups' TCPStore); "
                "ranks planning alone could tear down communicators the others keep"
            )
        self._free = free_bytes
        self._expected = expected_bytes
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.timeout = timeout
        self._round = 0

    def free_bytes(self) -> int | None:
        """Free bytes on this rank's device now (None: CUDA not initialised in this process)."""
        return self._free()

    def expected_bytes(self, tag: str | None) -> int | None:
        """What `tag` holds while resident, as the memory backend declares it (None: not known)."""
        return None if self._expected is None else self._expected(tag)

    def agree(self, inputs: BudgetInputs) -> BudgetInputs:
        """Every rank's inputs, reduced; the same on every rank (one round per call, in order)."""
        if self.world_size <= 1:
            return inputs
        r = self._round
        self._round += 1
        self.store.set(self._key(r, self.rank), json.dumps(inputs.to_dict()))
        keys = [self._key(r, k) for k in range(self.world_size)]
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError as exc:  # torch's DistStoreError: the store's own timeout
            missing = [k for k, key in enumerate(keys) if not self.store.check([key])]
            raise RendezvousTimeoutError(
                f"memory budget: rank {self.rank} waited {self.timeout.total_seconds():.0f} s in agreement "
                f"round {r} for ranks {missing}, which never posted their inputs ({exc}). Every rank of the "
                "group must sleep under the same budget (a rank without a declared need takes part too); "
                "look for the missing ranks' last lifecycle event in their logs",
                what=f"memory budget round {r}",
                missing=missing,
                waited_s=self.timeout.total_seconds(),
            ) from exc
        views = [BudgetInputs.from_dict(json.loads(self.store.get(k))) for k in keys]
        if r >= 2:  # every rank has posted round r-1, so all finished reading r-2
            self.store.delete_key(self._key(r - 2, self.rank))
        return agree(views)

    def _key(self, r: int, rank: int) -> str:
        return f"{self.prefix}/{r}/{rank}"


class DefaultStore:
    """The store of torch.distributed's default group, looked up at every call: where a framework
    re-creates WORLD between sleeps (slime's reloadable WORLD, a `PrefixStore` per generation over its
    rendezvous store), the store the ranks meet on now, not the one of the group that was.
    `DeviceMemoryProbe(store=DefaultStore(), ...)` agrees over it."""

    def _store(self) -> Any:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()

    def set(self, key: str, value: str) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store().get(key))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._store().wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._store().check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._store().delete_key(key))
