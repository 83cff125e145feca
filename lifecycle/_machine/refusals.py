"""What the machine says when it refuses an operation (no row in the table, or FAILED): the error,
with what happened, in which state and what to do next, and the `lifecycle.refused` event it logs first."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lifecycle._machine.failures import Failure
from lifecycle.errors import IllegalTransitionError, InvalidWeightsError, LifecycleFailedError
from lifecycle.table import (
    Contents,
    Groups,
    PolicyView,
    Residency,
    State,
    When,
    allowed_operations,
    invalid_weights,
    rows_for,
)

Refused = Callable[[dict[str, Any]], None]  # logs a lifecycle.refused event with these fields

_GUARD_ADVICE: dict[When, str] = {
    When.AUTO_WAKE: "the policy has auto_wake=False; call wake_up() first",
    When.AUTO_WAKE_OFFLOAD: "the policy has auto_wake=False; call wake_up() first",
    When.AUTO_WAKE_NO_OFFLOAD: "the policy has auto_wake=False; call wake_up() first",
    When.TARGET_AWAKE: "recover needs target=State.AWAKE or State.PAUSED",
    When.TARGET_PAUSED: "recover needs target=State.AWAKE or State.PAUSED",
}


def failed_error(
    who: str,
    operation: str,
    failure: Failure | None,
    reason: str | None,
    residency: dict[str, Residency],
    groups: Groups | None,
    refused: Refused,
) -> LifecycleFailedError:
    """`operation` on a FAILED machine (`reason`: why recover cannot run), as the error to raise."""
    hook = failure.hook if failure else "unknown"
    tag = f"[{failure.tag}]" if failure and failure.tag else ""
    error = failure.error if failure else ""
    phase = f" ({failure.phase})" if failure and failure.phase != "move" else ""
    what = (
        f"{who} is FAILED since hook {hook}{tag} raised {error} during {failure.operation}{phase} from "
        f"{failure.state}"
        if failure
        else f"{who} is FAILED"
    )
    advice = reason or (
        f"{operation} is refused until recover(target=State.AWAKE) or recover(target=State.PAUSED) succeeds"
    )
    refused({"operation": operation, "state": State.FAILED, "reason": advice})
    shown = {t: r.value for t, r in residency.items()}
    return LifecycleFailedError(
        f"{what}; residency {shown}, groups {groups and groups.value}. {advice}.",
        hook=hook,
        operation=operation,
        residency=residency,
        groups=groups,
        error=error,
    )


def refusal(
    who: str,
    operation: str,
    state: State,
    targets: tuple[str, ...],
    *,
    view: PolicyView,
    residency: Mapping[str, Residency],
    contents: Mapping[str, Contents],
    holds: int,
    weight_version: int | None,
    refused: Refused,
) -> IllegalTransitionError:
    """Why `operation` on `targets` has no row in `state`, as the error to raise."""
    allowed = allowed_operations(state)
    if operation == "release" and holds == 0:
        message = (
            f"{who} cannot release in {state}: no hold is taken (holds 0). Every release() gives "
            "back one hold() (`with lifecycle.held():` pairs them); remove this release, or take the hold first."
        )
        refused({"operation": operation, "state": state, "reason": message})
        return IllegalTransitionError(message, state=state, operation=operation, allowed=allowed)
    invalid = invalid_weights(view, contents)
    if invalid and any(row.when is When.WEIGHTS_VALID for row in rows_for(operation, state)):
        return _invalid_weights(who, operation, state, invalid, view, weight_version, refused)
    reasons = [_GUARD_ADVICE.get(row.when, f"needs {row.when.value}") for row in rows_for(operation, state)]
    if operation == "sync" and When.SYNC_TAGS_RESIDENT in [r.when for r in rows_for(operation, state)]:
        released = [t for t in view.sync_requires if residency[t] is not Residency.RESIDENT]
        reasons = [
            f"the sync body writes into {released}, which are released; call wake_up(tags={released}) first"
        ]
    if not reasons:
        if operation == "recover":
            reasons = [f"recover is only legal from FAILED and the machine is {state}; nothing to recover"]
        elif state is State.PAUSED:
            reasons = ["call wake_up() first"]
        else:
            reasons = [f"legal from {state}: {list(allowed)}"]
    message = f"{who} cannot {operation} from {state}: " + "; ".join(dict.fromkeys(reasons))
    refused({"operation": operation, "state": state, "reason": message, "targets": list(targets)})
    return IllegalTransitionError(message, state=state, operation=operation, allowed=allowed)


def _invalid_weights(
    who: str,
    operation: str,
    state: State,
    invalid: Mapping[str, Contents],
    view: PolicyView,
    weight_version: int | None,
    refused: Refused,
) -> InvalidWeightsError:
    why = {
        Contents.DISCARDED: "discarded (released without a backup: a wake maps fresh, meaningless memory)",
        Contents.UNKNOWN: "unknown (a hook or a sync touching it failed part-way)",
    }
    described = "; ".join(f"tag {t!r} holds {why[c]}" for t, c in invalid.items())
    message = (
        f"{who} cannot {operation} from {state}: {described}. The engine would serve "
        f"meaningless weights (vllm #29341). Sync first: wake_up({list(view.sync_requires) or None}) "
        f"if released, then update_weights(...) with the trainer's current version; {operation} is "
        "allowed once its final round is loaded."
    )
    tags = {t: c.value for t, c in invalid.items()}
    return _weights_refusal(operation, state, message, tags, weight_version, None, refused)


def stale_weights(
    who: str, operation: str, state: State, weight_version: int | None, required: int, refused: Refused
) -> InvalidWeightsError:
    """The weights loaded are older than the caller's `min_weight_version`, as the error to raise."""
    loaded = "an unknown version" if weight_version is None else f"version {weight_version}"
    message = (
        f"{who} cannot {operation} from {state}: it holds {loaded} of the weights and the caller "
        f"requires at least version {required} (a restarted or replaced engine serves its original "
        f"checkpoint, miles #1724). Sync version {required} or later first (update_weights)."
    )
    return _weights_refusal(operation, state, message, {}, weight_version, required, refused)


def _weights_refusal(
    operation: str,
    state: State,
    message: str,
    tags: dict[str, str],
    weight_version: int | None,
    required: int | None,
    refused: Refused,
) -> InvalidWeightsError:
    refused({"operation": operation, "state": state, "reason": message})
    return InvalidWeightsError(
        message,
        state=state,
        operation=operation,
        allowed=allowed_operations(state),
        tags=tags,
        weight_version=weight_version,
        required_version=required,
        fix="sync",  # both are fixed by a sync of a current version
    )
