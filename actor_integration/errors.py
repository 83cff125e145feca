"""The adapters' errors: memory, process groups, the actor group, weight sync, rollout engines, frameworks.

They live here, beside the adapters that raise them, and not in the pure core; all derive from
`lifecycle.LifecycleError` and pickle the same way (Ray ships exceptions by pickling). Each keeps
the built-in base callers already catch. `lifecycle.errors` still answers the old names for one
release (0.2 removes them), with a DeprecationWarning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lifecycle.errors import LifecycleError

# ------------------------------------------------------- memory (torch_memory_saver, model tags)


class MemorySaverConfigError(LifecycleError, ValueError):
    """A configuration torch_memory_saver would exit(1) on (or silently misread) later."""


class MemoryStateError(LifecycleError, RuntimeError):
    """A pause/resume/region call that torch_memory_saver would answer with exit(1)."""


class UnknownModelTagError(LifecycleError, KeyError):
    """No weight backup was taken under this model tag."""

    def __str__(self) -> str:
        # KeyError quotes its message; this one is a sentence.
        return str(self.args[0]) if self.args else ""


class WeightMismatchError(LifecycleError, ValueError):
    """The tensors given do not match the backup of a model tag (names, shapes or dtypes)."""


# ---------------------------------------------------------------------- ranks and process groups


class RendezvousTimeoutError(LifecycleError, TimeoutError):
    """Some ranks did not reach a meeting point before its deadline."""

    what: str
    missing: tuple[int, ...]
    waited_s: float

    def __init__(self, message: str, *, what: str, missing: Sequence[int], waited_s: float) -> None:
        super().__init__(message, what=what, missing=tuple(missing), waited_s=waited_s)


class RendezvousMismatchError(LifecycleError, RuntimeError):
    """Ranks met, but were doing different things (e.g. different new_group arguments)."""

    what: str
    other_rank: int
    other_what: str

    def __init__(self, message: str, *, what: str, other_rank: int, other_what: str) -> None:
        super().__init__(message, what=what, other_rank=other_rank, other_what=other_what)


class ProcessGroupsAsleepError(LifecycleError, RuntimeError):
    """A group was asked for (a collective, `new_group`, `connect`) while the process groups sleep.

    `state` is how they sleep: "destroyed", "suspended" or "kept" (`Groups`); `operation` what
    was asked; `group` the group's name, when one was named. A collective on a suspended NCCL
    communicator would read unmapped memory, so it is refused here, before it reaches NCCL.
    """

    state: str
    operation: str
    group: str | None

    def __init__(self, message: str, *, state: str, operation: str, group: str | None = None) -> None:
        super().__init__(message, state=state, operation=operation, group=group)


class NcclError(LifecycleError, RuntimeError):
    """An NCCL call (`call`) returned an error code (`code`; None: it could not be made), or a
    communicator cannot be reached; the message has NCCL's own words and the loaded version."""

    call: str
    code: int | None

    def __init__(self, message: str, *, call: str, code: int | None = None) -> None:
        super().__init__(message, call=call, code=code)


class PeersLostError(LifecycleError, RuntimeError):
    """A wait among ranks was given up because the driver said some of them are lost with their
    node (`LifecycleGroup` found it dead): no teardown waits out its deadline on a dead peer.
    Fields: `what` (the meeting), `lost` (the ranks), `reason`."""

    what: str
    lost: tuple[int, ...]
    reason: str

    def __init__(self, message: str, *, what: str, lost: Sequence[int], reason: str) -> None:
        super().__init__(message, what=what, lost=tuple(lost), reason=reason)


# ---------------------------------------------------------------- the driver's actor group (Ray)


class GroupTimeoutError(LifecycleError, TimeoutError):
    """Some actors of a `LifecycleGroup` did not answer within the deadline."""

    operation: str
    missing: list[int]
    waited_s: float

    def __init__(self, message: str, *, operation: str, missing: list[int], waited_s: float) -> None:
        super().__init__(message, operation=operation, missing=list(missing), waited_s=waited_s)


class DeadActorsError(LifecycleError, RuntimeError):
    """Some actors are dead; `.dead` maps each rank to its last known lifecycle state (or None)."""

    dead: dict[int, dict[str, Any] | None]

    def __init__(self, message: str, *, dead: dict[int, dict[str, Any] | None]) -> None:
        super().__init__(message, dead=dead)


class NodeLostError(DeadActorsError):
    """A Ray node died under a group: its actors are gone with it. Fields: `nodes` (node id → how
    the node was known), `lost` (role → the ranks that were on those nodes), `survivors` (role →
    rank → the state each surviving actor ended in), `operation` (what was running), `waited_s`
    (from the call to the verdict), and `dead` (rank → last known state, as `DeadActorsError`)."""

    nodes: dict[str, str]
    lost: dict[str, list[int]]
    survivors: dict[str, dict[int, str]]
    operation: str
    waited_s: float

    def __init__(
        self,
        message: str,
        *,
        nodes: Mapping[str, str],
        lost: Mapping[str, Sequence[int]],
        survivors: Mapping[str, Mapping[int, str]],
        operation: str,
        waited_s: float,
        dead: dict[int, dict[str, Any] | None],
    ) -> None:
        LifecycleError.__init__(
            self,
            message,
            nodes=dict(nodes),
            lost={role: list(ranks) for role, ranks in lost.items()},
            survivors={role: dict(states) for role, states in survivors.items()},
            operation=operation,
            waited_s=waited_s,
            dead=dead,
        )


class GroupCallError(LifecycleError, RuntimeError):
    """The call raised on some actors; `.errors` maps each rank to its exception."""

    operation: str
    errors: dict[int, BaseException]

    def __init__(self, message: str, *, operation: str, errors: dict[int, BaseException]) -> None:
        super().__init__(message, operation=operation, errors=errors)


class InconsistentGroupError(LifecycleError, RuntimeError):
    """Actors disagree on state or residency; `.groups` maps each distinct view to its ranks."""

    groups: dict[str, list[int]]

    def __init__(self, message: str, *, groups: dict[str, list[int]]) -> None:
        super().__init__(message, groups=groups)


# ----------------------------------------------------------------------------------- weight sync


class WeightSyncError(LifecycleError, RuntimeError):
    """A weight update failed; the fields (slot, version, ...) say which one."""


class WeightSyncTimeout(WeightSyncError):
    """A cross-process wait of a weight update passed its deadline. Fields: slot, version, awaited,
    waiting_rank, missing (the ranks or party that did not answer), waited_s, cause."""


class StaleVersionError(WeightSyncError):
    """The engine refused a version that is not newer than the one it has loaded."""


class CorruptBucketError(WeightSyncError):
    """A received bucket is truncated or fails its checksum. Nothing of the round was loaded,
    unless `written` is true (a receiver that checks while it writes, `keep_previous=False`)."""


class WrittenWeightsError(WeightSyncError):
    """After a round was written, the engine's tensors do not hold what the senders sent: the digest
    of what was written, computed where it was written, differs from the senders' checksum of the
    buckets (a loader or copy wrote something else). The weights are unknown (generation refused)
    until a round loads whole. Fields: version, round, buckets (their indices), expected, got,
    written (always true)."""


class EngineWeightsCheckError(WeightSyncError):
    """After a weight update, the engines' weights differ from what the same push writes again
    (slime's `/weights_checker` compare after a snapshot, a scramble and the push repeated: a tensor
    the push leaves unwritten, or a push writing other values each time). Field: version (the
    trainer's weight version)."""


# ---------------------------------------------------------------------- rollout engines (SGLang)


class EngineNotIdleError(LifecycleError, RuntimeError):
    """The engine still had requests after pausing generation; its memory was not released."""


class EngineDiedError(LifecycleError, RuntimeError):
    """A process of the rollout engine exited (SGLang's scheduler or detokenizer, vLLM's EngineCore):
    the engine can neither serve nor release memory any more. Fields: process (its name), pid, exitcode (None
    when unknown), call (what the adapter was doing), waited_s."""


class SGLangServerError(LifecycleError, RuntimeError):
    """An SGLang server refused a request (`status`, SGLang's text in `answer`) or could not be
    reached (`status` None). Fields: method, path, status, answer."""


class SGLangServerTimeout(LifecycleError, TimeoutError):
    """An SGLang server did not answer a request in time. Fields: method, path, timeout_s, and
    `missing` (the server's URL: who did not answer, as in every timeout of this library)."""


# ---------------------------------------------------------------------- rollout engines (vLLM)


class SleepTagsError(LifecycleError, ValueError):
    """A release of memory tags the engine cannot release alone (vLLM's sleep releases the weights
    and the KV cache together), refused before the engine is called. Fields: tags (asked),
    releasable (the sets the engine can release), engine."""


class WeightsDiscardedError(LifecycleError, RuntimeError):
    """A generation on weights the engine discarded (vLLM's level-2 sleep) and nobody reloaded since:
    vLLM would answer it with gibberish and no error. Fields: engine, level, weight_version."""


class WeightUpdateBusyError(WeightSyncError):
    """A second caller started a weight update on an engine while one was already in progress (two
    coordinators on one slot: vime #57). Fields: engine, owner (who holds the update), refused (who
    asked)."""


class DuplicateWeightUpdateStartError(WeightUpdateBusyError):
    """A second `start_weight_update` on one engine before its `finish_weight_update`, from a second
    would-be coordinator of the slot (vime #57), refused on the trainer's side (fields: rank, slot)
    or at the engine's actor (vime's `VLLMEngine` wrapped; fields: engine, call, open: the call
    that opened the update in progress)."""


class WeightUpdateNotStartedError(WeightSyncError):
    """Weights sent to, or a finish asked of, an engine that no `start_weight_update` opened; refused
    on the trainer's side (fields: rank, slot) or at the engine's actor (fields: engine, call)."""


class IncompleteSlotHandlesError(WeightSyncError, ValueError):
    """A chunk's IPC handles do not cover every GPU of the engine's slot (gathered over TP, not the
    slot: vime #57), refused before it is sent. Fields: rank, slot, weights."""


class IpcSerializationError(WeightSyncError, ValueError):
    """vLLM's own IPC weight transfer asked of an engine whose processes cannot carry CUDA IPC
    handles: vLLM sends them pickled, and its EngineCore decodes pickles only where
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1` was set before it started. Refused before vLLM is called.
    Fields: engine, variable."""


class VLLMServerError(LifecycleError, RuntimeError):
    """A vLLM server refused a request (`status`, vLLM's text in `answer`) or could not be reached
    (`status` None). Fields: method, path, status, answer."""


class VLLMServerTimeout(LifecycleError, TimeoutError):
    """A vLLM server did not answer a request in time. Fields: method, path, timeout_s, missing (the
    server's URL)."""


# -------------------------------------------------------------------------------- frameworks (miles)


class OffloadTrainRequiredError(LifecycleError, ValueError):
    """`sleep()` or `wake_up()` of a miles actor without `--offload-train` (miles asserts it). Field: `method`."""


class MilesVersionError(LifecycleError, TypeError):
    """miles' actor module lacks a name the adapter calls: a miles other than the one it is written
    against (`MILES_COMMIT`). Fields: `module`, `missing`."""


# ------------------------------------------------------------------------ placement across nodes


class PlacementError(LifecycleError, ValueError):
    """Trainer ranks and rollout engines are not where colocation needs them: a slot whose engine
    runs on one node spans several, or an engine rank is not on its trainer rank's GPU. Fields:
    slot, engine, ranks (the slot's), nodes (node → the slot's ranks there)."""


class CrossNodeTransportError(PlacementError):
    """A weight transport that only works within one host (cuda_ipc, shm) was asked for between
    two nodes; refused before anything is exported. Fields: requested, sender_node, receiver_node."""


# ------------------------------------------- a framework's SGLang engine actors (slime, miles)


class RouterError(LifecycleError, RuntimeError):
    """The router refused or could not be reached while an engine actor added or removed its server.

    Fields: router (its URL), worker (the server's URL), operation ("add" or "remove"), path,
    status (None: unreachable), answer. The server's own state is unchanged by the failed call.
    """


class StaleWeightsError(LifecycleError, RuntimeError):
    """A server reports weights other than the version its actor saw loaded whole (`/model_info`'s
    weight_version): it is kept out of the router. Fields: url, reported, expected."""


class FollowerCallError(LifecycleError, RuntimeError):
    """A call that drives an engine's server was made on a follower actor (`node_rank != 0`), which
    sends nothing: the server is driven by the engine's node-0 actor. Fields: node_rank, call,
    leader (the server's URL when known, else None)."""


# ------------------------------------------------- switching a framework job on at its launch


class LaunchConfigError(LifecycleError, ValueError):
    """The launch switch cannot do what the job asks: a value of `RL_LIFECYCLE_WRAP` it does not know,
    or a framework whose module or class is not where the adapter reads it (another version).
    Fields: `framework`, `variable` or `module` where they apply."""


class UnwrappedClassError(LifecycleError, TypeError):
    """The job asked for a half under the lifecycle, and this process creates that half's class
    unwrapped (its own `actor_cls`, a path that builds the class elsewhere). Raised when the actor is
    created, before it does any work. Fields: `framework`, `half`, `created` (the class made)."""


class PreflightError(LifecycleError, RuntimeError):
    """What the job needs is more than the machine has: one line per shortfall, each saying what to
    change. Field: `shortfalls` (their lines)."""


class UnknownEngineError(LifecycleError, ValueError):
    """A rollout engine's name nothing registered (`rollout.registry`). Fields: `name`, `known`
    (the registered names)."""


# Every class above; `lifecycle.errors.MOVED_TO_ADAPTERS` names those 0.1 defined in the core.
__all__ = sorted(
    name
    for name, value in dict(globals()).items()
    if isinstance(value, type) and issubclass(value, LifecycleError) and value.__module__ == __name__
)
