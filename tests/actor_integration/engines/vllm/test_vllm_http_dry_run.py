"""The GPU test of `VLLMHTTPEngine` on `vllm serve` (tests/gpu/test_vllm_http_gpu.py), run on CPU.

The same launch (`vllm_http_checks.launched`: its `vllm serve` command line and environment, a child
process waited on at `GET /health`, its tree killed) and the same checks, with the program the fake
`vllm serve` (`vime_serve.FAKE_PROGRAM`: vLLM 0.26.0's routes and killers, the lifecycle's worker
extension in its workers), our sender shm (its files open in the server's process as CUDA IPC handles
do in vLLM's workers), and vLLM's IPC sender one whose handles carry the tensors. What it cannot
show: vLLM's own answers, its memory (no bytes are measured: the freed-bytes check is skipped, only
the workers' report is read), its tokens, and the timings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import vllm_http_checks as checks

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[checks.Rig]:
    from tests.helpers.vime_serve import FAKE_PROGRAM, inline_sender
    from tests.helpers.vllm_fake import weights
    from tests.helpers.vllm_source import cached_wheel, open_tree
    from tests.helpers.weight_sync_doubles import shm_sender_into

    open_tree().close()  # the wheel, fetched once (or this suite skips offline)
    wheel = cached_wheel()
    assert wheel is not None
    with checks.launched(
        (*FAKE_PROGRAM, "--wheel", str(wheel)),
        "tiny",
        tmp_path_factory.mktemp("vllm-http"),
        make_sender=lambda actor: shm_sender_into(actor, bucket_bytes=1 << 10),
        deadline_s=60.0,
        engine_options={"timeout_s": 10.0, "ipc_sender": inline_sender},
        sets={"A": weights(1), "B": weights(2)},
        prompts=PROMPTS,
        new_tokens=NEW_TOKENS,
    ) as rig:
        yield rig


def test_0_the_command_line_is_one_vllm_0_26_serve_defines(rig: checks.Rig) -> None:
    from tests.helpers.vime_serve import unknown_serve_flags
    from tests.helpers.vllm_source import cached_wheel

    wheel = cached_wheel()
    assert wheel is not None
    flags, unknown = unknown_serve_flags(rig.figures["argv"], wheel)
    assert "--worker-extension-cls" in flags and unknown == [], unknown
    assert rig.figures["workers"] and rig.figures["vllm_report"] == {"weights": 4096, "kv_cache": 256}


def test_1_cycles_serve_each_sets_tokens(rig: checks.Rig) -> None:
    figures = checks.cycles(rig, 4)
    print(f"\n{ {k: v for k, v in figures.items() if k != 'rows'} }")
    assert figures["served_version"] == "4" and figures["freed_at_least"] is None
    assert all(r["freed_bytes"] is None and r["reported_bytes"] == 4352 for r in figures["rows"])


def test_1b_the_cycles_catch_a_wrong_token_and_a_missing_refusal(
    rig: checks.Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks can fail: tokens other than the set's first ones, or a generation served while the
    weights are discarded (each failing cycle still ends awake on set A, the rig usable after)."""
    wrong = dataclasses.replace(rig, tokens={**rig.tokens, "A": [[0] * NEW_TOKENS for _ in PROMPTS]})
    with pytest.raises(AssertionError, match="other tokens"):
        checks.cycles(wrong, 1)
    rig.version = wrong.version
    served = rig.actor.generate
    monkeypatch.setattr(rig.actor, "generate", lambda *a, **k: served(*a, **k) if k else [[1]])
    with pytest.raises(AssertionError, match="not refused"):
        checks.cycles(rig, 1)
    monkeypatch.undo()
    assert rig.actor.generate(PROMPTS, min_weight_version=rig.version) == rig.tokens["A"]


def test_2_vllms_own_ipc_path_serves_the_same_tokens(rig: checks.Rig) -> None:
    figures = checks.vllm_ipc(rig)
    print(f"\n{figures}")
    assert figures["same_tokens_as_ours"]


def test_3_the_killers_are_refused_and_the_server_lives(rig: checks.Rig) -> None:
    out = checks.killers(rig)
    print(f"\n{out}")
    assert out["update_asleep"].startswith("MemoryStateError") and "57853" in out["update_asleep"]
    assert out["second_start"].startswith("WeightUpdateBusyError")


def test_3b_a_killer_the_client_sends_fails_the_check(
    rig: checks.Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal that reached the server first is caught (the guard's refusal moved after the request)."""
    engine = rig.engine
    check = engine.guard.check_resume

    def late(tags: Any) -> Any:
        engine.alive()
        return check(tags)

    monkeypatch.setattr(engine.guard, "check_resume", late)
    with pytest.raises(AssertionError, match="refused only after sending"):
        checks.killers(rig)
    monkeypatch.undo()
    engine.resume_memory_occupation(["kv_cache"])  # where the failed check left it: set A loaded again
    engine.continue_generation()
    rig.version += 1
    engine.load_weights(rig.version, [list(rig.sets["A"].items())], round_index=0, final=True)
    assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == rig.tokens["A"]


def test_3c_own_routes_and_the_wrapped_sleep_side_by_side(rig: checks.Rig) -> None:
    """The GPU test's side-by-side runs on the fake server: both sides time three calls per cycle,
    each call's time in the client's request and in the server's engine (its log's lines) beside it,
    with the release audit on and off; set A serves its tokens again after."""
    figures = checks.own_and_wrapped(rig, cycles=3)
    assert figures["cycles"] == 3 and figures["same_tokens_as_A"]
    phases = {"sleep_ms", "wake_weights_ms", "wake_kv_ms"}
    keys = phases | {f"{p}_in_engine" for p in phases} | {"sleep_wake_ms"}
    for run in (figures, figures["audit_off"], figures["own_vs_own"]):
        assert set(run["own"]) == set(run["wrapped"]) == keys
        assert [len(run["rows"][side]) for side in ("own", "wrapped")] == [3, 3]
        assert all(
            set(row) == keys and min(row.values()) > 0 for side in run["rows"].values() for row in side
        )
        assert all(
            row[p] >= row[f"{p}_in_engine"] for side in run["rows"].values() for row in side for p in phases
        )
        assert run["order"] == ["own", "wrapped", "wrapped", "own", "own", "wrapped"]
        # the own side calls the client's request and nothing else; the wrapped side runs the actor too
        assert set(run["outside_engine_ms"]) == {"own", "wrapped"}
        assert run["engine_log"] == "18 sleep/wake lines, one per call", run["engine_log"]
        for side in ("own", "wrapped"):
            assert set(run["engine_ms"][side]) == phases
            assert set(run["net_ms"][side]) == phases | {"sleep_wake_ms"}
            assert all(ms > 0 for ms in run["net_ms"][side].values())
        assert isinstance(run["wrapped_minus_own_net_ms"], float)
        assert isinstance(run["target_met"], bool) and run["target_ms"] == 3.0


def test_4_a_killed_server_is_a_typed_error_within_the_deadline(rig: checks.Rig) -> None:
    figures = checks.killed_server(rig, deadline_s=10.0)
    print(f"\n{figures}")
    assert figures["exitcode"] == -9, figures
    assert figures["actor_sleep"]["waited_s"] < 5 and figures["engine_generate"]["waited_s"] < 5, figures
    assert figures["actor_sleep"]["typed"] == figures["engine_generate"]["error"] == "VLLMServerError", (
        figures
    )
