"""What a vLLM engine may be asked, decided before vLLM is: the sleep level and tag table, and the
refusals of the calls the field reports vLLM answering with a crash, a hang or gibberish.

vLLM 0.26.0's sleep (`LLM.sleep(level)`, `POST /sleep?level=`) always releases the weights and the
KV cache together: its executor marks both tags asleep (`sleeping_tags = {"weights", "kv_cache"}`),
and a second sleep is ignored with a warning while any tag is still asleep. The level says what
becomes of the weights: level 1 copies them to host RAM (restored on wake), level 2 discards them
(a weight load must follow the wake). `wake_up(tags)` wakes a subset ("weights" or "kv_cache"), and
generation resumes only once every tag is awake. So:

| tags asked to release            | what vLLM is called with         | afterwards                           |
|----------------------------------|----------------------------------|--------------------------------------|
| None, {"weights", "kv_cache"}    | `sleep(level)`                   | both asleep; level 2: weights lost   |
| {"weights"} alone                | refused (`SleepTagsError`)       | nothing called                       |
| {"kv_cache"} alone               | refused (`SleepTagsError`)       | nothing called                       |
| tags asked to resume             |                                  |                                      |
| None                             | `wake_up(None)`                  | both awake                           |
| {"weights"} / {"kv_cache"}       | `wake_up([tag])`                 | the other still asleep: no serving   |

Standard library only: the in-worker module and the HTTP client import it without vLLM or torch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from actor_integration.errors import (
    EngineNotIdleError,
    MemoryStateError,
    SleepTagsError,
    WeightsDiscardedError,
    WeightUpdateBusyError,
)

VLLM_TAGS = ("weights", "kv_cache")  # what vLLM's CuMemAllocator tags (vllm/device_allocator/cumem.py)
SLEEP_LEVELS = (1, 2)  # 0 pauses scheduling only: that is `pause_generation`, not a release
# Our pause modes (SGLang's names) and vLLM's own (vllm/v1/engine/__init__.py: PauseMode) -> vLLM's.
# vLLM has no "retract": a pause either aborts, drains ("wait") or freezes ("keep") the requests.
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "keep": "keep", "wait": "wait"}


def vllm_pause_mode(mode: str) -> str:
    """vLLM's pause mode for `mode` (one of ours or vLLM's); ValueError naming the choices otherwise."""
    if mode not in PAUSE_MODES:
        raise ValueError(
            f"vLLM pause mode must be one of {sorted(PAUSE_MODES)} (in_place is vLLM's 'keep'), got {mode!r}; "
            "vLLM has no 'retract'"
        )
    return PAUSE_MODES[mode]


def chosen_tags(tags: Sequence[str] | None, who: str) -> tuple[str, ...]:
    """`tags` (None: every tag) checked against vLLM's tags, in vLLM's order."""
    if tags is None:
        return VLLM_TAGS
    if isinstance(tags, str):
        raise TypeError(f"{who}: tags is a list of tag names, got the string {tags!r}; pass [{tags!r}]")
    unknown = sorted(set(tags) - set(VLLM_TAGS))
    if unknown:
        raise ValueError(f"{who}: unknown memory tags {unknown}; vLLM's are {list(VLLM_TAGS)}")
    if not tags:
        raise ValueError(f"{who}: no tags given; pass None for every tag")
    return tuple(t for t in VLLM_TAGS if t in tags)


class SleepGuard:
    """The engine's memory and weight state as this adapter's calls left it, and the refusals.

    `resident`: which tags are awake. `weights_discarded`: a level-2 sleep dropped the weights and
    no whole version was loaded since. `in_flight`: generations this adapter has running.
    `update_owner`: who holds the weight update in progress (one coordinator per slot).
    `layers_unloaded`: a failed update left the model's layers on vLLM's meta device (its worker ends
    the session of a chunk that failed inside it without putting them back): what happened, until a
    whole version loads."""

    def __init__(self, engine: str, level: int) -> None:
        self.engine = engine
        self.level = self.checked_level(level)
        self.resident = dict.fromkeys(VLLM_TAGS, True)
        self.weights_discarded = False
        self.weights_mixed: int | None = None  # a version partly loaded (a later round failed)
        self.layers_unloaded: str | None = None
        self.in_flight = 0
        self.update_owner: str | None = None
        self._lock = threading.Lock()

    def checked_level(self, level: int) -> int:
        """`level` if vLLM can sleep at it, else the ValueError naming the levels."""
        if level not in SLEEP_LEVELS:
            raise ValueError(
                f"{self.engine}: sleep_level must be 1 (weights to host RAM, KV cache discarded) or 2 (both "
                f"discarded, a weight load must follow), got {level!r}"
            )
        return level

    def set_level(self, level: int) -> None:
        """The level of the next sleep (a caller that picks it per sleep, as vime's rollout manager does);
        refused while a tag sleeps: the sleep in force keeps the level it was taken at."""
        level = self.checked_level(level)
        asleep = [t for t in VLLM_TAGS if not self.resident[t]]
        if asleep and level != self.level:
            raise MemoryStateError(
                f"{self.engine}: {asleep} asleep at level {self.level}; the level of a sleep is chosen before it",
                tags=asleep,
            )
        self.level = level

    # ------------------------------------------------------------------ memory

    def check_release(self, tags: Sequence[str] | None) -> int:
        """The sleep level to call vLLM with for releasing `tags`, or the refusal."""
        chosen = chosen_tags(tags, f"{self.engine}.release_memory_occupation")
        if chosen != VLLM_TAGS:
            raise SleepTagsError(
                f"{self.engine}: vLLM cannot release {list(chosen)} alone: its sleep releases the weights and "
                f"the KV cache together (level 1 keeps the weights in host RAM, level 2 discards them). "
                "Release both (tags=None); nothing was called.",
                tags=list(chosen),
                releasable=[list(VLLM_TAGS)],
                engine=self.engine,
            )
        asleep = [t for t in VLLM_TAGS if not self.resident[t]]
        if asleep:
            raise MemoryStateError(
                f"{self.engine}: {asleep} still asleep; a second sleep makes vLLM's allocator release twice "
                "(vllm #36651), and vLLM ignores it while any tag sleeps. Wake every tag first.",
                tags=asleep,
            )
        if self.update_owner is not None:
            raise MemoryStateError(
                f"{self.engine}: a weight update by {self.update_owner!r} is in progress; finish or abort it "
                "before the engine sleeps",
                tags=list(chosen),
            )
        if self.layers_unloaded is not None and self.level == 2:
            raise MemoryStateError(
                f"{self.engine}: {self.layers_unloaded}; vLLM's level-2 sleep copies the model's buffers to "
                "host and fails on them ('Cannot copy out of meta tensor'). Load a whole weight version "
                "first; nothing was called.",
                tags=list(chosen),
            )
        if self.in_flight:
            raise EngineNotIdleError(
                f"{self.engine}: {self.in_flight} generation(s) in flight; sleeping under live requests is an "
                "illegal memory access in vLLM (vllm #28714, #27901). Pause generation and let them end "
                "(the rollout's sleep does), then sleep.",
                queued={"running": self.in_flight, "waiting": 0},
            )
        return self.level

    def released(self) -> None:
        for tag in VLLM_TAGS:
            self.resident[tag] = False
        if self.level == 2:
            self.weights_discarded = True

    def check_resume(self, tags: Sequence[str] | None) -> list[str] | None:
        """What to pass to vLLM's `wake_up` (None: every tag), or the refusal of a second wake."""
        chosen = chosen_tags(tags, f"{self.engine}.resume_memory_occupation")
        awake = [t for t in chosen if self.resident[t]]
        if awake:
            raise MemoryStateError(
                f"{self.engine}: {awake} already awake; a second wake makes vLLM's allocator map twice "
                "(vllm #36651). Wake only what sleeps.",
                tags=awake,
            )
        return None if tags is None else list(chosen)

    def resumed(self, tags: list[str] | None) -> None:
        for tag in VLLM_TAGS if tags is None else tags:
            self.resident[tag] = True

    def residency(self) -> dict[str, bool]:
        return dict(self.resident)

    def weights(self) -> str:
        """Where the weights are: "resident", "host" (level-1 sleep) or "discarded" (level 2, until a load)."""
        if self.weights_discarded:
            return "discarded"
        return "resident" if self.resident["weights"] else "host"

    # ------------------------------------------------------------------ serving

    def check_generate(self) -> None:
        asleep = [t for t in VLLM_TAGS if not self.resident[t]]
        if asleep == ["kv_cache"]:
            raise MemoryStateError(
                f"{self.engine}: only the weights are awake; generating with the KV cache asleep is an illegal "
                "memory access in vLLM. Wake the KV cache first (wake_up(['kv_cache'])).",
                tags=asleep,
            )
        if asleep:
            raise MemoryStateError(
                f"{self.engine}: {asleep} asleep; generating while asleep is an illegal memory access or a hang "
                "in vLLM (vllm #15483, #45326). Wake every tag first.",
                tags=asleep,
            )
        why, version = self._unservable()
        if why is not None:
            raise WeightsDiscardedError(
                f"{self.engine}: {why}", engine=self.engine, level=self.level, weight_version=version
            )

    def _unservable(self) -> tuple[str | None, int | None]:
        """Why the resident weights cannot be served (None: they can), and the version concerned."""
        if self.layers_unloaded is not None:
            return (
                f"{self.layers_unloaded}; vLLM has no weights to generate with. Load a whole weight version first.",
                None,
            )
        if self.weights_discarded:
            return (
                "the weights were discarded by a level-2 sleep and not reloaded; vLLM would generate gibberish "
                "without an error (vllm #29341, #15254, #54235). Load a whole weight version first.",
                None,
            )
        if self.weights_mixed is not None:
            return (
                f"version {self.weights_mixed} was loaded in part (a later round failed); load a whole version "
                "before generating",
                self.weights_mixed,
            )
        return None, None

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        with self._lock:
            self.check_generate()
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    # ------------------------------------------------------------------ weights

    def check_load(self, what: str) -> None:
        """A weight load needs the weights awake (the KV cache may sleep: the colocated wake loads
        between `wake_up(["weights"])` and `wake_up(["kv_cache"])`)."""
        if not self.resident["weights"]:
            raise MemoryStateError(
                f"{self.engine}: {what} while the weights sleep writes into unmapped memory: vLLM's EngineCore "
                "segfaults, the server stays up and the trainer times out (vllm #57853). Wake the weights "
                "first (wake_up(['weights'])).",
                tags=["weights"],
            )

    def begin_update(self, owner: str) -> None:
        """Claim the engine's weight update for `owner`; a second claim is refused (vime #57)."""
        with self._lock:
            self.check_load(f"a weight update by {owner!r}")
            if self.update_owner is not None:
                raise WeightUpdateBusyError(
                    f"{self.engine}: {owner!r} tried to start a weight update while {self.update_owner!r} holds "
                    "one; one coordinator per engine (two starting one update broke vime's 8-GPU slots, vime "
                    "#57). Finish or abort the first.",
                    engine=self.engine,
                    owner=self.update_owner,
                    refused=owner,
                )
            self.update_owner = owner

    def end_update(self, owner: str, *, version: int | None) -> None:
        """Release the claim; `version` is the whole version now served (None: the update failed)."""
        with self._lock:
            if self.update_owner != owner:
                raise WeightUpdateBusyError(
                    f"{self.engine}: {owner!r} ended a weight update it does not hold (holder: "
                    f"{self.update_owner!r})",
                    engine=self.engine,
                    owner=self.update_owner,
                    refused=owner,
                )
            self.update_owner = None
            if version is not None:
                self.weights_discarded = False
                self.weights_mixed = None
                self.layers_unloaded = None


__all__ = ["PAUSE_MODES", "SLEEP_LEVELS", "VLLM_TAGS", "SleepGuard", "chosen_tags", "vllm_pause_mode"]
