"""Host copies of the weights per model tag ("actor", "ref", "old_actor"), and the switch-model hook.

slime keeps one pinned CPU copy per tag and `_switch_model(tag)` copies it back into the GPU
parameters; after a wake the paused weights hold whatever the last switch left, so the wake plan
restores "actor". Buffers are allocated once per tag and reused: a fresh host copy per step grew
host RAM until the sync OOMed (vime #57).

A copy is as old as its last `backup()`, and training moves the model past it: restoring it over
the tag already in place would undo those steps (issue 14: every wake reset a trainer to the copy
taken at configuration). `ModelTagSwitch` therefore copies nothing when the tag asked for is the
one in place and the pause kept the memory's contents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

import torch

from actor_integration.errors import UnknownModelTagError, WeightMismatchError

__all__ = [
    "CpuWeightBackup",
    "ModelTagSwitch",
    "UnknownModelTagError",
    "WeightMismatchError",
    "named_model_tensors",
]


def named_model_tensors(
    model: torch.nn.Module | Sequence[torch.nn.Module],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and buffers of a model, or of a list of model chunks (Megatron) prefixed "<chunk>."."""
    if isinstance(model, torch.nn.Module):
        yield from model.named_parameters()
        yield from model.named_buffers()
        return
    for index, chunk in enumerate(model):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"model chunk {index} is a {type(chunk).__name__}, not a torch.nn.Module")
        for name, tensor in named_model_tensors(chunk):
            yield f"{index}.{name}", tensor


class CpuWeightBackup:
    """Named host copies of tensors per tag, in pinned memory when CUDA is available."""

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._backups: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def tags(self) -> tuple[str, ...]:
        """The model tags that have a host copy."""
        return tuple(self._backups)

    def backup(self, tag: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the tensors into the tag's host buffers, allocating them on the tag's first backup only."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"model tag must be a non-empty string, got {tag!r}")
        given = _collect(named_tensors, f"backup({tag!r})")
        buffers = self._backups.get(tag)
        if buffers is None:
            buffers = {
                name: torch.empty_like(
                    t, device="cpu", memory_format=torch.contiguous_format, pin_memory=self.pin_memory
                )
                for name, t in given.items()
            }
        else:
            _check_match(tag, buffers, given, "backup")
        with torch.no_grad():
            for name, tensor in given.items():
                buffers[name].copy_(tensor.detach(), non_blocking=True)
        _synchronize(given.values())
        self._backups[tag] = buffers

    def restore(self, tag: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the tag's host buffers back into the given tensors, in place; checks everything first."""
        buffers = self._get(tag)
        given = _collect(named_tensors, f"restore({tag!r})")
        _check_match(tag, buffers, given, "restore")
        with torch.no_grad():
            for name, tensor in given.items():
                tensor.copy_(buffers[name], non_blocking=True)
        _synchronize(given.values())

    def tensors(self, tag: str) -> Mapping[str, torch.Tensor]:
        """Read-only mapping of the tag's host copies (what a weight sync reads while GPU memory is paused)."""
        return MappingProxyType(self._get(tag))

    def nbytes(self, tag: str) -> int:
        """Host bytes the copies of `tag` hold."""
        return sum(t.nbytes for t in self._get(tag).values())

    def _get(self, tag: str) -> dict[str, torch.Tensor]:
        buffers = self._backups.get(tag)
        if buffers is None:
            known = list(self._backups) or "none yet"
            raise UnknownModelTagError(f"no weight backup under model tag {tag!r}; backed-up tags: {known}")
        return buffers

    def __repr__(self) -> str:
        sizes = ", ".join(f"{t}={self.nbytes(t) / 2**20:.1f} MiB" for t in self._backups)
        return f"<CpuWeightBackup pinned={self.pin_memory} {sizes or 'empty'}>"


class ModelTagSwitch:
    """`switch_model(tag)` for a Lifecycle: put `tag`'s weights in the model; `.active` is the tag in place.

    A switch to the tag in place copies nothing (the model may be trained past its backup), unless
    `contents_kept=False` says a pause discards the model's memory (torch_memory_saver without CPU
    backup): then every switch restores, and the tag's backup must be refreshed after each train
    step, as slime does. `active` names the tag the model holds now, if known.
    """

    def __init__(
        self,
        backup: CpuWeightBackup,
        model_getter: Callable[[], torch.nn.Module | Sequence[torch.nn.Module]],
        *,
        active: str | None = None,
        contents_kept: bool = True,
    ) -> None:
        if not isinstance(backup, CpuWeightBackup):
            raise TypeError(f"ModelTagSwitch needs a CpuWeightBackup, got {type(backup).__name__}")
        if isinstance(model_getter, torch.nn.Module) or not callable(model_getter):
            raise TypeError(
                "ModelTagSwitch needs model_getter: a callable returning the model (or its chunks), e.g. "
                f"`lambda: model`; got {type(model_getter).__name__}"
            )
        if active is not None and active not in backup.tags:
            raise UnknownModelTagError(
                f"ModelTagSwitch(active={active!r}): no backup under that tag yet; backed-up tags: {list(backup.tags)}"
            )
        if not isinstance(contents_kept, bool):
            raise TypeError(f"ModelTagSwitch(contents_kept=...) must be a bool, got {contents_kept!r}")
        self.backup = backup
        self.model_getter = model_getter
        self.active: str | None = active
        self.contents_kept = contents_kept

    def __call__(self, tag: str) -> None:
        if self.contents_kept and tag == self.active:
            return  # in place, and possibly newer than its backup
        try:
            self.backup.restore(tag, named_model_tensors(self.model_getter()))
        except (UnknownModelTagError, WeightMismatchError):
            raise  # checked before any copy: the model still holds `active`
        except BaseException:
            self.active = None  # a copy may have run part way: the weights are no known tag
            raise
        self.active = tag

    def __repr__(self) -> str:
        return f"<ModelTagSwitch active={self.active!r} tags={list(self.backup.tags)} contents_kept={self.contents_kept}>"


def _collect(named_tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"{where}: expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if name in out:
            raise WeightMismatchError(f"{where}: tensor name {name!r} appears twice")
        out[name] = tensor
    if not out:
        raise WeightMismatchError(f"{where}: no tensors given")
    return out


def _check_match(
    tag: str, buffers: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], op: str
) -> None:
    missing = sorted(set(buffers) - set(given))
    extra = sorted(set(given) - set(buffers))
    if missing or extra:
        raise WeightMismatchError(
            f"{op}({tag!r}): the tensors do not match the tag's backup: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{'...' if len(extra) > 5 else ''} "
            f"({len(missing)} missing, {len(extra)} unexpected). Pass the same model the tag was backed up from."
        )
    wrong = [
        f"{name}: backup {tuple(buffers[name].shape)} {buffers[name].dtype}, given {tuple(t.shape)} {t.dtype}"
        for name, t in given.items()
        if t.shape != buffers[name].shape or t.dtype != buffers[name].dtype
    ]
    if wrong:
        raise WeightMismatchError(
            f"{op}({tag!r}): shape or dtype differs from the tag's backup for {len(wrong)} tensors: "
            + "; ".join(wrong[:5])
        )


def _synchronize(tensors: Iterable[torch.Tensor]) -> None:
    # non_blocking copies between pinned host and device memory finish only after a sync.
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
