"""miles' own `SGLangEngine` (its source at the commit `actor_integration.frameworks.miles` pins)
under `MilesRolloutMixin`, as miles runs it: a Ray actor with miles' engine environment, launching a
real SGLang 0.5.17 HTTP server through miles' own `launch_server_process`, behind a local router;
the same tests as slime's (`test_slime_rollout_gpu.py`), on one server, in file order.

miles at that commit computes only server arguments SGLang 0.5.17 has. Its trainer opens a
weight-update session (`/begin_weight_update`) that 0.5.17 has no route for, so the framework's
own push here is the flattened-bucket `update_weights_from_tensor` without one, as slime's.

Run (scripts/gpu_sglang.sh miles sets sglang and Ray up): RL_LIFECYCLE_MILES_SOURCE=<miles tree> \\
    python -m pytest -m gpu -q -s tests/gpu/test_miles_rollout_gpu.py
The wrapped actor's lifecycle log goes to $LIFECYCLE_GPU_OUT/miles-rollout-logs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang")

from tests.gpu.test_slime_rollout_gpu import (  # after the skips: it needs both
    pytestmark,
    rig,
    test_1_the_frameworks_own_calls_on_the_server,
    test_2_cycles_of_the_frameworks_sequence_under_the_wrap,
    test_2b_the_frameworks_own_cycle_and_the_wrapped_one_in_turn,
    test_3_the_three_killing_sequences_are_absorbed_and_the_server_lives,
    test_4_requests_sent_all_along_are_never_served_on_released_or_stale_weights,
    test_5_our_sender_into_the_same_server_loads_the_same_weights_no_slower_than_the_frameworks_push,
    test_5b_a_request_sent_to_the_sleeping_server_waits_for_the_wake_and_the_new_version,
    test_6_a_release_on_a_hung_server_is_a_typed_timeout_and_recovers_without_a_restart,
    test_7_a_killed_server_is_a_typed_error_naming_it_and_the_router_is_told,
)

FRAMEWORK = "miles"

__all__ = [
    "pytestmark",
    "rig",
    "test_1_the_frameworks_own_calls_on_the_server",
    "test_2_cycles_of_the_frameworks_sequence_under_the_wrap",
    "test_2b_the_frameworks_own_cycle_and_the_wrapped_one_in_turn",
    "test_3_the_three_killing_sequences_are_absorbed_and_the_server_lives",
    "test_4_requests_sent_all_along_are_never_served_on_released_or_stale_weights",
    "test_5_our_sender_into_the_same_server_loads_the_same_weights_no_slower_than_the_frameworks_push",
    "test_5b_a_request_sent_to_the_sleeping_server_waits_for_the_wake_and_the_new_version",
    "test_6_a_release_on_a_hung_server_is_a_typed_timeout_and_recovers_without_a_restart",
    "test_7_a_killed_server_is_a_typed_error_naming_it_and_the_router_is_told",
]
