"""`RolloutEngine` over an offline `vllm.LLM` (imported lazily: vllm is an optional extra).

Written against vLLM 0.26.0 (pyproject's `vllm` extra); CI checks every call this module makes
against that wheel's source (tests/actor_integration/engines/vllm/test_vllm_source.py).

The offline `LLM` has no pause call of its own: vLLM's level-0 sleep is its scheduler pause
(`LLM.sleep(level=0, mode)`), and `wake_up(["scheduling"])` resumes it; a sleep at level 1 or 2
pauses the scheduler itself first, and vLLM resumes scheduling once every tag is awake again.

vLLM runs the model in its EngineCore process (`engine_processes()`); one that exited answers every
later call with `EngineDiedError` (naming it, its pid and exit code), checked before the call, and
vLLM's own `EngineDeadError` becomes the same error. A death while a call waits on vLLM is seen
only where vLLM raises: its synchronous client can wait on a dead engine's output for ever.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from actor_integration.engines.vllm.base import IpcSender, VLLMAdapter
from actor_integration.engines.vllm.worker import WORKER_EXTENSION
from actor_integration.errors import EngineDiedError, EngineNotIdleError, IpcSerializationError

SUPPORTED_VERSION = "0.26.0"
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def insecure_serialization() -> bool:
    """Whether vLLM, reading this process's environment, would carry pickles between its processes
    (`vllm.envs.VLLM_ALLOW_INSECURE_SERIALIZATION`, parsed as vLLM parses it)."""
    try:
        return bool(int(os.environ.get(INSECURE_SERIALIZATION, "0")))
    except ValueError:
        return False


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "the vLLM rollout adapter needs vllm: `pip install 'rl-lifecycle[vllm]'`; without it use "
            "actor_integration.rollout.ReferenceEngine"
        ) from exc
    return vllm


def llm_arguments(kwargs: dict[str, Any], *, worker_receiver: bool) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` with sleep mode on, the IPC weight transfer, and the workers' receiver;
    ValueError, before vLLM starts, for arguments that contradict them."""
    if "model" not in kwargs:
        raise ValueError("VLLMEngine: give model= (a path or hub name), or an LLM as llm=")
    if kwargs.get("enable_sleep_mode") is False:
        raise ValueError(
            "VLLMEngine: enable_sleep_mode=False leaves nothing to release; the rollout lifecycle needs "
            "vLLM's sleep mode (drop the argument: it is turned on)"
        )
    out = {**kwargs, "enable_sleep_mode": True}
    out.setdefault("weight_transfer_config", {"backend": "ipc"})
    extension = out.get("worker_extension_cls") or ""
    if worker_receiver:
        if extension and extension != WORKER_EXTENSION:
            raise ValueError(
                f"VLLMEngine: vLLM takes one worker_extension_cls; {extension!r} was given and the lifecycle's "
                f"receiver needs {WORKER_EXTENSION!r}. Subclass both into one, or pass worker_receiver=False."
            )
        out["worker_extension_cls"] = WORKER_EXTENSION
    return out


class VLLMEngine(VLLMAdapter):
    """Adapts `vllm.LLM` to `RolloutEngine`. Pass an `LLM` (started with `enable_sleep_mode=True`,
    and `worker_extension_cls=WORKER_EXTENSION` unless `worker_receiver=False`), or the keyword
    arguments to build one.

    `sleep_level`: 2 (default) discards the weights on release, a sync reloads them; 1 keeps them
    in host RAM (mind the host memory: vime #190). `sampling_params` builds vLLM's `SamplingParams`
    (tests); `ipc_sender` replaces vLLM's IPC sender for `load_weights` (tests)."""

    def __init__(
        self,
        llm: Any = None,
        *,
        sleep_level: int = 2,
        worker_receiver: bool = True,
        ipc_sender: IpcSender | None = None,
        packed: bool = True,
        sampling_params: Callable[..., Any] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        super().__init__(
            sleep_level=sleep_level, worker_receiver=worker_receiver, ipc_sender=ipc_sender, packed=packed
        )
        # EngineCore reads the variable when it starts: what it was then decides what it can decode.
        self._pickles_at_start = insecure_serialization()
        if llm is None:
            arguments = llm_arguments(llm_kwargs, worker_receiver=worker_receiver)
            llm = import_vllm().LLM(**arguments)
        elif llm_kwargs:
            raise ValueError(f"VLLMEngine: got an LLM and LLM arguments {sorted(llm_kwargs)}; give one")
        self.llm = llm
        self._sampling = sampling_params
        self._died: EngineDiedError | None = None
        config = llm.llm_engine.vllm_config
        if not getattr(config.model_config, "enable_sleep_mode", False):
            raise ValueError(
                "VLLMEngine: the LLM was started without enable_sleep_mode=True: vLLM's sleep would free nothing"
            )
        self.tp_size = int(getattr(config.parallel_config, "tensor_parallel_size", 1))
        if worker_receiver:
            try:
                self.workers = self._rpc("lifecycle_hello", "{}")
            except Exception as exc:
                raise ValueError(
                    f"VLLMEngine: vLLM's workers do not answer lifecycle_hello ({exc!r}); start the LLM with "
                    f"worker_extension_cls={WORKER_EXTENSION!r}, or pass worker_receiver=False"
                ) from exc

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tp_size": self.tp_size, "supported": SUPPORTED_VERSION}

    def queued_requests(self) -> dict[str, int]:
        """What vLLM still holds: its unfinished requests (running and waiting together)."""
        return {"running": int(self.llm.llm_engine.get_num_unfinished_requests()), "waiting": 0}

    def _check_idle(self) -> None:
        if self._paused:
            return  # vLLM's sleep aborts (or keeps, frozen) what the pause left
        if self.llm.llm_engine.has_unfinished_requests():
            queued = self.queued_requests()
            raise EngineNotIdleError(
                f"VLLMEngine: {queued['running']} request(s) unfinished in vLLM and generation not paused; "
                "sleeping under live requests is an illegal memory access (vllm #28714, #27901). Pause "
                "generation first (the rollout's sleep does).",
                queued=queued,
            )

    # ------------------------------------------------------------------ vLLM's EngineCore

    def engine_processes(self) -> dict[str, int]:
        """vLLM's EngineCore processes under this LLM, name → pid: none where EngineCore runs in this
        process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
        return {str(p.name): int(p.pid) for p in self._core_processes()}

    def shutdown(self) -> None:
        """Stop vLLM's EngineCore (its client's own shutdown)."""
        self.llm.llm_engine.engine_core.shutdown()

    def _core_processes(self) -> list[Any]:
        core = self.llm.llm_engine.engine_core
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", None) or [])

    def _dead_process(self, what: str) -> EngineDiedError | None:
        for proc in self._core_processes():
            if not proc.is_alive():
                return EngineDiedError(
                    f"vLLM's {proc.name} process (pid {proc.pid}) exited with code {proc.exitcode} before "
                    f"{what}: the engine can neither serve nor release memory any more. Restart the rollout "
                    "actor and its engine; its lifecycle stays FAILED until then",
                    process=str(proc.name),
                    pid=int(proc.pid),
                    exitcode=proc.exitcode,
                    call=what,
                    waited_s=0.0,
                )
        return None

    @contextlib.contextmanager
    def _vllm(self, what: str) -> Iterator[None]:
        """One call into vLLM: refused with `EngineDiedError` once its EngineCore exited, and vLLM's
        `EngineDeadError` (or any error while EngineCore lies dead) raised as that error."""
        if self._died is None:
            self._died = self._dead_process(what)
        if self._died is not None:
            raise EngineDiedError(str(self._died), **{**self._died.fields, "call": what})
        try:
            yield
        except Exception as exc:
            died = self._dead_process(what)
            if died is None and type(exc).__name__ == "EngineDeadError":
                died = EngineDiedError(
                    f"vLLM's EngineCore died during {what} ({exc}); restart the rollout actor and its engine",
                    process="EngineCore",
                    pid=None,
                    exitcode=None,
                    call=what,
                    waited_s=0.0,
                )
            if died is None:
                raise
            self._died = died
            raise died from exc

    # ------------------------------------------------------------------ vLLM's calls

    def _sleep(self, level: int, mode: str) -> None:
        with self._vllm("sleep"):
            self.llm.sleep(level=level, mode=mode)

    def _wake(self, tags: list[str] | None) -> None:
        with self._vllm("wake_up"):
            self.llm.wake_up(tags=tags)

    def _pause(self, mode: str) -> None:
        with self._vllm("pause"):
            self.llm.sleep(level=0, mode=mode)

    def _resume(self) -> None:
        with self._vllm("resume"):
            self.llm.wake_up(tags=["scheduling"])

    def _reset_prefix_cache(self) -> bool:
        with self._vllm("reset_prefix_cache"):
            return bool(self.llm.reset_prefix_cache())

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        make = self._sampling or import_vllm().SamplingParams
        params = make(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        with self._vllm("generate"):
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def _rpc(self, method: str, request: str) -> list[dict[str, Any]]:
        with self._vllm(method):
            replies = self.llm.collective_rpc(method, args=(request,))
        return [dict(r) for r in replies]

    def _check_ipc_transfer(self) -> None:
        """vLLM's IPC update sends CUDA IPC handles (a rebuild function and `torch.Tensor` among its
        arguments) from this process to EngineCore through its msgpack client, which pickles them only
        with `VLLM_ALLOW_INSECURE_SERIALIZATION=1` here and in EngineCore (set before the engine was
        built); without it vLLM raises only after its start has put the model's layers on the meta
        device (seen on an H100, vLLM 0.26.0)."""
        if self._pickles_at_start and insecure_serialization():
            return
        when = "now" if self._pickles_at_start else "when the engine was built"
        raise IpcSerializationError(
            f"{type(self).__name__}: vLLM's own IPC weight transfer needs {INSECURE_SERIALIZATION}=1, unset "
            f"{when}: vLLM pickles the CUDA IPC handles between this process and its EngineCore. Set it in "
            "the rollout actor's environment before the engine starts (the Ray runtime env's env_vars), or "
            "sync through the lifecycle's sender (worker_receiver=True, no pickles). Nothing was sent.",
            engine=type(self).__name__,
            variable=INSECURE_SERIALIZATION,
        )

    def _start_update(self) -> None:
        with self._vllm("start_weight_update"):
            self.llm.start_weight_update()

    def _update(self, update_info: dict[str, Any]) -> None:
        with self._vllm("update_weights"):
            self.llm.update_weights({"update_info": update_info})

    def _finish_update(self) -> None:
        with self._vllm("finish_weight_update"):
            self.llm.finish_weight_update()
