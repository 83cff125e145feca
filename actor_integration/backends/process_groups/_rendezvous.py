"""Meeting points among ranks over the rendezvous store, with deadlines that name the missing ranks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from actor_integration.errors import PeersLostError, RendezvousMismatchError, RendezvousTimeoutError

NAMESPACE = "rl-lifecycle/process-groups"
NEW_GROUP_CAUSE = (
    "dist.new_group is collective: every rank must call new_group with the same arguments in the same "
    "order, even ranks that are not in `ranks`. Likely cause: new_group called inside a rank branch "
    "(e.g. `if rank in ranks:`), or those ranks crashed or are stuck in earlier work"
)
LIFECYCLE_CAUSE = (
    "every rank must sleep()/wake_up() (destroy()/reload()) together. Likely cause: the lifecycle was "
    "driven on some ranks only, or those ranks crashed or are still busy (a longer step than the deadline)"
)
BARRIER_CAUSE = (
    "Likely cause: those ranks skipped this barrier (a rank branch), crashed, or are slower than the deadline"
)
# A wait polls this often for `abandon` (called from another thread): a rank told its peers are
# lost gives up within this, not at the deadline.
POLL_S = 0.25


class Meeting:
    """Store-based meeting points with deadlines; every arriving rank can name the missing ones."""

    def __init__(self, store: Store, rank: int, world_size: int) -> None:
        self._store = PrefixStore(f"{NAMESPACE}/meet", store)
        self._rank = rank
        self._world_size = world_size
        self._round = 0
        self._lost: tuple[tuple[int, ...], str] | None = None

    def abandon(self, lost: Sequence[int], reason: str) -> None:
        """Give up on the `lost` ranks (their node died): the wait in progress ends within `POLL_S`
        and every later `meet` at once, with `PeersLostError`. Safe to call from another thread."""
        self._lost = (tuple(sorted(lost)), reason)

    def meet(self, what: str, timeout: timedelta, cause: str) -> None:
        """Block until every rank called `meet` with the same `what` at this position."""
        self._refuse_if_lost(what)
        n, s, me = self._round, self._store, self._rank
        self._round += 1
        t0 = time.monotonic()
        s.set(f"{n}/rank{me}", what)
        first = s.compare_set(f"{n}/what", "", f"{me}\n{what}").decode()
        first_rank, first_what = first.split("\n", 1)
        if first_what != what:
            s.set(f"{n}/mismatch", f"{me}\n{what}")
            s.set(f"{n}/done", "mismatch")  # wake the ranks already waiting
            raise self._mismatch(what, int(first_rank), first_what)
        if s.add(f"{n}/count", 1) == self._world_size:
            s.set(f"{n}/done", "ok")
        deadline = t0 + timeout.total_seconds()
        while True:
            step = max(min(POLL_S, deadline - time.monotonic()), 0.001)
            try:
                s.wait([f"{n}/done"], timedelta(seconds=step))
                break
            except dist.DistNetworkError as exc:
                raise RuntimeError(
                    f"rank {me} lost the rendezvous store while waiting in {what} ({exc}); the store lives in "
                    "rank 0's process (or the launcher's), which probably exited"
                ) from exc
            except dist.DistStoreError as exc:
                self._refuse_if_lost(what)
                if time.monotonic() >= deadline:
                    raise self._timeout(n, what, time.monotonic() - t0, timeout, cause) from exc
        if s.check([f"{n}/mismatch"]):
            other_rank, other_what = s.get(f"{n}/mismatch").decode().split("\n", 1)
            raise self._mismatch(what, int(other_rank), other_what)
        # Everyone has left round n-2 once anyone is here in round n: its keys are dead.
        if n >= 2:
            s.delete_key(f"{n - 2}/rank{me}")
            s.delete_key(f"{n - 2}/value{me}")  # a `gather`'s, read by everyone before round n-1
            if me == 0:
                for key in ("what", "count", "done"):
                    s.delete_key(f"{n - 2}/{key}")

    def gather(self, what: str, value: str, timeout: timedelta, cause: str) -> list[str]:
        """`meet`, and every rank's `value` (index: rank). The same deadline and errors as `meet`."""
        n, s = self._round, self._store
        s.set(f"{n}/value{self._rank}", value)
        self.meet(what, timeout, cause)
        return [s.get(f"{n}/value{r}").decode() for r in range(self._world_size)]

    def _refuse_if_lost(self, what: str) -> None:
        if self._lost is None:
            return
        lost, reason = self._lost
        raise PeersLostError(
            f"rank {self._rank} gave up {what}: ranks {list(lost)} are lost ({reason}), so no rank waits on "
            "them any more. The groups cannot be rebuilt without them: close() them (local, no peer waits) "
            "and restart the job from its last checkpoint.",
            what=what,
            lost=lost,
            reason=reason,
        )

    def _timeout(
        self, n: int, what: str, waited: float, timeout: timedelta, cause: str
    ) -> RendezvousTimeoutError:
        try:
            missing = [r for r in range(self._world_size) if not self._store.check([f"{n}/rank{r}"])]
        except dist.DistError:
            missing = []
        who = f"ranks {missing}" if missing else "some ranks (the store could not be read)"
        message = (
            f"rank {self._rank} waited {waited:.1f} s (deadline {timeout.total_seconds():.1f} s) in {what} "
            f"for {who} of world size {self._world_size} to reach the same call; they never arrived. {cause}."
        )
        return RendezvousTimeoutError(message, what=what, missing=missing, waited_s=waited)

    def _mismatch(self, what: str, other_rank: int, other_what: str) -> RendezvousMismatchError:
        message = (
            f"rank {self._rank} is in {what}, but rank {other_rank} reached the same point in {other_what}. "
            "new_group, barrier, destroy and reload are collective: every rank must make the same calls "
            "in the same order (for new_group with the same arguments, even ranks not in `ranks`). "
            "Likely cause: one of them is called inside a rank branch (e.g. `if rank in ranks:`). "
            "The groups are now out of step: close() them and restart the actors."
        )
        return RendezvousMismatchError(message, what=what, other_rank=other_rank, other_what=other_what)
