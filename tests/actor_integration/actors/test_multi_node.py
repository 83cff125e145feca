"""Beyond one host, on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`):
a head with no CPUs and two worker nodes, each with its own resource (`node_a`, `node_b`) and its own
default log directory, so placement is forced and every rank's log lands on its own node.

The demo joins it with `--address` (each slot on its own node, the transport per pair of nodes,
`lifecycle check` clean), a node removed mid-step is a typed error naming the node, ranks and
engines, the weight transports run between two nodes (nccl over gloo, disk) or are refused
(cuda_ipc, shm), and the logs of both nodes are gathered through Ray for check and timeline.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from actor_integration.actors.mixin import LifecycleMixin
from lifecycle.events import LOG_DIR_ENV
from tests.conftest import start_local_ray
from tests.helpers.cli import lifecycle
from tests.helpers.slime_like import LifecycleSlimeActor

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

TIMEOUT_S = 20.0  # every cross-actor deadline of these runs (the demo's --timeout-s)
DEMO = ("--trainers", "4", "--engines", "2", "--hidden", "32", "--layers", "1", "--no-progress")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """Head (0 CPUs) + nodes a and b (2 CPUs each); this process is a driver on it."""
    from ray.cluster_utils import Cluster

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()  # the session's one-node cluster: restarted after this module
    logs = tmp_path_factory.mktemp("node-logs")
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    # Cluster writes its address where a bare `ray.init()` on this machine would join it: undo that,
    # so that no other test (nor a demo without --address) lands on this cluster.
    address_file = Path(ray._private.utils.get_ray_address_file(None))
    if address_file.exists() and address_file.read_text().strip() == made.address:
        address_file.unlink()

    def add(name: str) -> Any:
        env = {LOG_DIR_ENV: str(logs / name), "RAY_USAGE_STATS_ENABLED": "0"}
        return made.add_node(num_cpus=2, resources={f"node_{name}": 1}, env_vars=env)

    removed: list[tuple[Any, float]] = []  # (node, when replaced) until the GCS counts it dead

    def replace(name: str, lost: Any) -> None:
        """A fresh node `name` in place of the removed `lost`. Until the GCS counts `lost` dead (its
        health checks, some seconds) it still offers its `node_<name>` resource, and an actor the
        next test places on `name` can land on it and die unstarted ("its node has died": seen in
        CI): `settle` waits for that before the next test (`_removed_nodes_are_dead`), not here, so
        that the module's last test does not wait out the GCS for no test after it."""
        nodes[name] = add(name)
        removed.append((lost, time.monotonic()))

    def settle() -> None:
        """Return once the GCS counts every node removed so far dead (120 s after its replace at most)."""
        while removed:
            lost, replaced_at = removed[0]
            if not any(n["NodeID"] == lost.node_id and n["Alive"] for n in ray.nodes()):
                removed.pop(0)
            elif time.monotonic() > replaced_at + 120:
                raise AssertionError(
                    f"node {lost.node_id[:8]} still alive in the GCS 120 s after its removal"
                )
            else:
                time.sleep(0.5)

    nodes = {name: add(name) for name in ("a", "b")}
    made.wait_for_nodes()
    ray.init(address=made.address, log_to_driver=False, configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test classes, shipped by value
    handle = SimpleNamespace(
        cluster=made, nodes=nodes, logs=logs, address=made.address, add=add, replace=replace, settle=settle
    )
    yield handle
    ray.shutdown()
    made.shutdown()
    if was_up:
        start_local_ray(ray)


@pytest.fixture(autouse=True)
def _removed_nodes_are_dead(cluster: SimpleNamespace) -> None:
    """Before every test: each node an earlier test removed (and replaced) is dead in the GCS."""
    cluster.settle()


def node_id(handle: SimpleNamespace, name: str) -> str:
    return str(handle.nodes[name].node_id)


def on(name: str) -> dict[str, Any]:
    """`.options(...)` that puts an actor on node `name` (its own resource)."""
    return {"resources": {f"node_{name}": 0.01}, "num_cpus": 0}


# ---------------------------------------------------------------------------------------------- the demo


@pytest.fixture(scope="module")
def demo(cluster: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("demo-2-nodes")
    proc = lifecycle(
        "demo",
        "--address",
        cluster.address,
        "--steps",
        "2",
        "--timeout-s",
        str(TIMEOUT_S),
        "--out",
        str(out),
        *DEMO,
    )
    return (
        out,
        proc,
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {},
    )


class TestDemoAcrossNodes:
    def test_it_joins_the_cluster_says_what_it_found_and_checks_clean(self, demo) -> None:
        out, proc, summary = demo
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert "3 node(s), 4 CPUs, 0 GPUs" in proc.stdout and "joined Ray cluster at" in proc.stdout
        assert summary["ok"] and summary["findings"] == []
        check = lifecycle("check", str(out / "logs"))
        assert check.returncode == 0 and "6 file(s)" in check.stderr and "clean" in check.stderr

    def test_each_slot_sits_on_its_own_node_with_its_engine(self, demo, cluster) -> None:
        """Slot 0 (ranks 0, 1, engine 0) on one worker node, slot 1 (ranks 2, 3, engine 1) on the
        other: spread over the nodes, each kept on one node, ranks in node order."""
        _, _, summary = demo
        slots = [(s["ranks"], s["engine"]) for s in summary["slots"]]
        assert slots == [([0, 1], 0), ([2, 3], 1)]
        first, second = (s["node"] for s in summary["slots"])
        assert {first, second} == {node_id(cluster, "a"), node_id(cluster, "b")}
        places = summary["places"]
        assert [places["trainer"][str(r)]["node_id"] for r in range(4)] == [first, first, second, second]
        assert [places["rollout"][str(e)]["node_id"] for e in range(2)] == [first, second]

    def test_the_transport_is_chosen_per_pair_of_nodes_as_designed(self, demo) -> None:
        _, proc, summary = demo
        first, second = (s["node"] for s in summary["slots"])
        rows = [
            (t["sender_node"], t["receiver_node"], t["transport"], t["ranks"], t["engines"])
            for t in summary["transports"]
        ]
        assert rows == [(first, first, "shm", [0, 1], [0]), (second, second, "shm", [2, 3], [1])]
        assert summary["transports"] == summary["designed_transports"]
        assert "weight transport per (sender node, receiver node)" in proc.stdout

    def test_the_logs_are_gathered_through_ray_and_the_timeline_reads_them(self, demo, tmp_path) -> None:
        out, proc, _ = demo
        assert "logs gathered through Ray: 6 log file(s)" in proc.stdout
        gathered = json.loads((out / "logs" / "gathered.json").read_text())
        assert len(gathered["files"]) == 6 and gathered["unread"] == {}
        drawn = lifecycle("timeline", str(out / "logs"), "-o", str(tmp_path / "timeline"), "--no-png")
        assert drawn.returncode == 0 and (tmp_path / "timeline.json").is_file()


# ---------------------------------------------------------------------------------------------- transports


class Sender:
    """A trainer rank on one node that sends one version to an engine on another."""

    def where(self) -> dict[str, Any]:
        from actor_integration.actors.cluster import here

        return here()

    def address(self) -> str:
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def join(self, init_method: str) -> None:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=init_method, rank=0, world_size=2, timeout=datetime.timedelta(seconds=30)
        )
        self.group = dist.new_group([0, 1], backend="gloo")

    def send(
        self, requested: str, between: tuple[str, str], engine: Any, directory: str | None
    ) -> dict[str, Any]:
        from actor_integration.weight_sync import RankSlot, WeightSender, configure_sender
        from tests.helpers.models import perturbed

        transport = configure_sender(
            requested,
            colocated=False,
            same_node=between[0] == between[1],
            between=between,
            group=getattr(self, "group", None),
            src=0,
            device="cpu",
            directory=directory,
        )
        sender = WeightSender(
            RankSlot.single(0),
            None,
            transport,
            rank=0,
            engine_call=lambda v, p: ray.get(engine.update_weights.remote(v, p), timeout=30),
            bucket_bytes=4096,
            deadline_s=30.0,
        )
        weights = perturbed(CONFIG, 1, scale=0.1).named_weights()
        report = sender.send(1, weights.items())
        sender.close()
        from actor_integration.models.tiny import weights_checksum

        return {"transport": report.transport, "checksum": weights_checksum(weights)}


def _engine_config() -> Any:
    from actor_integration.models.tiny import TinyLMConfig

    return TinyLMConfig(vocab_size=61, dim=16, n_layers=2, n_heads=2, max_seq_len=32, seed=3)


CONFIG = _engine_config()


class BroadcastEngine:
    """A non-colocated rollout engine on another node: joins the sender's gloo group for nccl."""

    def __init__(self, init_method: str | None) -> None:
        from actor_integration.rollout import ReferenceEngine, RolloutActor
        from actor_integration.weight_sync import WeightReceiver
        from actor_integration.weight_sync.nccl import NcclReceiver

        transports = {}
        if init_method is not None:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=init_method, rank=1, world_size=2, timeout=datetime.timedelta(seconds=30)
            )
            transports["nccl"] = NcclReceiver(dist.new_group([0, 1], backend="gloo"), src=0)
        self.rollout = RolloutActor(
            ReferenceEngine(CONFIG, devices=["cpu"]),
            receiver=WeightReceiver(transports=transports),
            log_dir="off",  # the node's log directory is the gather test's
        )
        self.rollout.sleep()
        self.rollout.wake_up(["weights"])

    def where(self) -> dict[str, Any]:
        from actor_integration.actors.cluster import here

        return here()

    def update_weights(self, version: int, payloads: list[Any]) -> dict[str, Any]:
        return self.rollout.update_weights(version, payloads)

    def weights_checksum(self) -> str:
        return self.rollout.weights_checksum()

    def weight_version(self) -> int | None:
        return self.rollout.weight_version()


def remote_pair(cluster: SimpleNamespace, requested: str) -> tuple[Any, Any, Any]:
    """A sender on node a, a non-colocated engine on node b, and their node topology."""
    from actor_integration.weight_sync import NodeTopology, Place, SlotTopology

    sender = ray.remote(Sender).options(**on("a")).remote()
    init_method = ray.get(sender.address.remote()) if requested in ("auto", "nccl") else None
    engine = ray.remote(BroadcastEngine).options(**on("b"), max_concurrency=2).remote(init_method)
    if init_method is not None:
        ray.get(sender.join.remote(init_method), timeout=60)
    here_a, here_b = ray.get([sender.where.remote(), engine.where.remote()], timeout=60)
    # One trainer rank, no colocated engine, one remote engine of one GPU: fed by rank 0 over nodes.
    topology = NodeTopology.plan(
        SlotTopology.plan(1, [1], [1]), [Place(here_a["node_id"])], [[Place(here_b["node_id"])]]
    )
    return sender, engine, topology


class TestTransportsAcrossNodes:
    @pytest.mark.parametrize("requested", ["auto", "disk"])
    def test_a_version_crosses_two_nodes_bit_exact_by_the_pairs_transport(
        self, cluster, requested, tmp_path
    ) -> None:
        """auto between nodes is nccl (a gloo broadcast here); disk needs a directory both mount
        (this machine's tmp). The engine's weights come out bit-equal to the sender's."""
        sender, engine, topology = remote_pair(cluster, requested)
        (row,) = topology.transport_table(requested)
        assert (row.sender_node, row.receiver_node) == (node_id(cluster, "a"), node_id(cluster, "b"))
        assert row.transport == ("nccl" if requested == "auto" else "disk")
        between = (row.sender_node, row.receiver_node)
        sent = ray.get(sender.send.remote(requested, between, engine, str(tmp_path)), timeout=90)
        assert sent["transport"] == row.transport
        assert ray.get(engine.weights_checksum.remote()) == sent["checksum"]
        for actor in (sender, engine):
            ray.kill(actor)

    @pytest.mark.parametrize("requested", ["cuda_ipc", "shm"])
    def test_a_host_only_transport_between_nodes_is_refused_before_any_export(
        self, cluster, requested
    ) -> None:
        from actor_integration.errors import CrossNodeTransportError

        sender, engine, topology = remote_pair(cluster, requested)
        with pytest.raises(CrossNodeTransportError):
            topology.transport_table(requested)
        between = (node_id(cluster, "a"), node_id(cluster, "b"))
        before = ray.get(engine.weight_version.remote())
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(sender.send.remote(requested, between, engine, None), timeout=60)
        assert isinstance(info.value.cause, CrossNodeTransportError)
        assert f"refused between nodes {between[0][:8]} and {between[1][:8]}" in str(info.value.cause)
        assert ray.get(engine.weight_version.remote()) == before  # nothing reached the engine
        for actor in (sender, engine):
            ray.kill(actor)


# ---------------------------------------------------------------------------------------------- logs


class FlushingSlimeActor(LifecycleSlimeActor):
    def flush(self) -> bool:
        import lifecycle

        return lifecycle.flush_logs()


class TestGatherLogs:
    def test_one_command_brings_every_nodes_logs_for_check_and_timeline(self, cluster, tmp_path) -> None:
        """Each actor writes to its own node's default log directory (RL_LIFECYCLE_LOG_DIR of that
        node's raylet); `lifecycle gather` copies both into one directory that check reads clean."""
        actors = [ray.remote(FlushingSlimeActor).options(**on(name)).remote() for name in ("a", "b")]
        ray.get([a.init.remote(rank=i) for i, a in enumerate(actors)], timeout=60)
        ray.get([a.wake_up.remote() for a in actors], timeout=60)
        paths = ray.get([a.lifecycle_log_path.remote() for a in actors], timeout=60)
        assert [Path(p).parent for p in paths] == [cluster.logs / "a", cluster.logs / "b"]
        assert all(ray.get([a.flush.remote() for a in actors], timeout=60))
        dest = tmp_path / "gathered"
        proc = lifecycle("gather", "--address", cluster.address, "-o", str(dest))
        for actor in actors:
            ray.kill(actor)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "2 log file(s) from 2 node(s)" in proc.stdout
        manifest = json.loads((dest / "gathered.json").read_text())
        assert {n for holders in manifest["files"].values() for n in holders} == {
            node_id(cluster, "a"),
            node_id(cluster, "b"),
        }
        assert {p.name for p in dest.glob("*.jsonl")} == {Path(p).name for p in paths}
        check = lifecycle("check", str(dest))
        assert check.returncode == 0 and "2 file(s)" in check.stderr
        drawn = lifecycle("timeline", str(dest), "-o", str(tmp_path / "t"), "--no-png")
        assert drawn.returncode == 0


# ---------------------------------------------------------------------------------------------- a lost node


class TestLostNode:
    """Last in the module: each test removes a node and adds a fresh one in its place."""

    def test_a_node_removed_mid_step_is_a_typed_error_naming_node_ranks_and_engines(
        self, cluster, tmp_path
    ) -> None:
        """The node of slot 1 dies while the trainers train (step 2): within --timeout-s + 5 s the demo
        shows a NodeLostError naming that node, trainer ranks [2, 3] and engine [1]; the survivors end FAILED
        (their teardown gave up on the lost ranks) or as they were; nothing of the run is left
        running; `lifecycle check` names the lost ranks."""
        out = tmp_path / "demo"
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        command = [sys.executable, "-m", "actor_integration.tools.cli", "demo", "--address", cluster.address]
        command += ["--steps", "3", "--timeout-s", str(TIMEOUT_S), "--out", str(out), *DEMO]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        lines: list[str] = []
        name: str | None = None
        removed_at: float | None = None
        error_at: float | None = None
        lost: Any = None
        try:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("slot 1 on node "):  # the node of trainer ranks 2, 3 and engine 1
                    name = next(n for n, node in cluster.nodes.items() if line.split()[4] == node.node_id[:8])
                if removed_at is None and name and "step 2: trainer wakes, trains, sleeps" in line:
                    lost = cluster.nodes.pop(name)
                    cluster.cluster.remove_node(lost, allow_graceful=False)
                    removed_at = time.monotonic()
                if error_at is None and "NodeLostError" in line:
                    error_at = time.monotonic()
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            if lost is not None and name is not None:
                cluster.replace(name, lost)  # the module's cluster back to two worker nodes
        text = "".join(lines)
        assert removed_at is not None and error_at is not None, text[-3000:]
        assert proc.returncode == 1, text[-3000:]
        assert error_at - removed_at < TIMEOUT_S + 5, (error_at - removed_at, text[-3000:])
        summary = json.loads((out / "summary.json").read_text())
        lost_info = summary["node_lost"]
        assert list(lost_info["nodes"]) == [lost.node_id]
        assert lost_info["lost"] == {"trainer": [2, 3], "rollout": [1]}
        error = lost_info["error"]
        # Whichever group's call noticed it (the trainers' train, the rollouts' wake), both are named.
        assert error.startswith("NodeLostError: ") and f": node {lost.node_id[:8]}" in error
        assert "trainer ranks [2, 3]; rollout engines [1] ran there and are gone" in error
        # The survivors end in a known state: FAILED after giving up on the lost ranks, or as they were.
        settled = lost_info["settled"]
        assert set(settled["trainer"]) == {"0", "1"} and set(settled["rollout"]) == {"0"}
        for state in [*settled["trainer"].values(), *settled["rollout"].values()]:
            # A survivor blocked on the lost ranks past its own deadlines (a rebuild, then a
            # collective in its body) is killed by the demo, and says so.
            assert state.split()[0] in ("FAILED", "PAUSED", "AWAKE") or state.startswith(
                "killed by the driver"
            )
        # Nothing of the run keeps running once the demo is over.
        pids = [p["pid"] for role in ("trainer", "rollout") for p in summary["places"][role].values()]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.5)
        assert not [pid for pid in pids if _running(pid)], pids
        # `lifecycle check` names the lost ranks instead of calling the run clean.
        check = lifecycle("check", str(out / "logs"))
        assert check.returncode == 1
        assert "trainer ranks [2, 3]; rollout ranks [1] lost (node " + lost.node_id[:8] in check.stdout


class _GlooBody:
    """A trainer's body that only works: no collective in it, so what the survivors wait on after the
    loss is the lifecycle's own teardown (gloo's ring all-reduce would wait out its timeout on a
    killed peer, cut short by no one)."""

    groups: Any

    def train(self, seconds: float) -> int:
        time.sleep(seconds)
        return 0


class GlooTrainer(LifecycleMixin, _GlooBody):
    """Real reloadable gloo groups that every train wakes and every sleep destroys (collectively)."""

    def address(self) -> str:
        with socket.socket() as s:
            s.bind(("", 0))
            return f"tcp://{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    def setup(self, rank: int, world_size: int, init_method: str) -> dict[str, Any]:
        from actor_integration.backends.memory_saver import NoopMemory
        from actor_integration.backends.process_groups import ReloadableProcessGroups
        from lifecycle import Hooks, LifecyclePolicy

        self.groups = ReloadableProcessGroups.init(
            backend="gloo",
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        policy = LifecyclePolicy(offload_train=True, memory_tags=("model",))
        memory = NoopMemory(tags=("model",))
        self.configure_lifecycle(
            policy, Hooks(memory=memory, process_groups=self.groups), rank=rank, role="trainer"
        )
        self.lifecycle.bind(world_size=world_size)
        self.sleep()
        return self.lifecycle_state()


class TestLostNodeUnderAGroup:
    def test_the_group_names_the_node_and_its_ranks_and_the_survivors_give_up_on_them(self, cluster) -> None:
        """Two ranks on each node, in train (its body, then the sleep that destroys the groups, a
        meeting of all four); the node of ranks 2 and 3 is removed: NodeLostError from the call,
        the survivors FAILED once their teardown gave up on the lost ranks (PeersLostError), not at
        the 20 s deadline; the group refuses to go on until told."""
        from actor_integration.actors.ray_group import LifecycleGroup
        from actor_integration.errors import DeadActorsError, NodeLostError

        cls = ray.remote(max_concurrency=2)(GlooTrainer)
        actors = [cls.options(**on(name)).remote() for name in ("a", "a", "b", "b")]
        init_method = ray.get(actors[0].address.remote(), timeout=60)
        ray.get([a.setup.remote(r, 4, init_method) for r, a in enumerate(actors)], timeout=60)
        group = LifecycleGroup(actors, timeout_s=TIMEOUT_S, role="trainer")
        places = group.locate()
        assert [places[r]["node_id"] for r in range(4)] == [node_id(cluster, n) for n in "aabb"]
        lost = cluster.nodes.pop("b")
        try:
            threading.Timer(1.0, cluster.cluster.remove_node, (lost,), {"allow_graceful": False}).start()
            started = time.monotonic()
            with pytest.raises(NodeLostError) as info:
                group.call("train", 3.0, ranks=[0, 1, 2, 3])
            waited = time.monotonic() - started
        finally:
            cluster.replace("b", lost)
        error = info.value
        assert waited < TIMEOUT_S / 2, waited  # their teardown was cut short, not waited out (20 s)
        assert list(error.nodes) == [lost.node_id] and error.lost == {"trainer": [2, 3]}
        assert sorted(error.dead) == [2, 3] and error.operation == "train"
        assert f"trainer train: node {lost.node_id[:8]}" in str(error)
        for rank in (0, 1):
            state = error.survivors["trainer"][rank]
            assert state.startswith("FAILED") and "process_groups.destroy raised PeersLostError" in state, (
                state
            )
        assert group.settle(timeout_s=1) == error.survivors["trainer"]
        with pytest.raises(DeadActorsError, match="refusing lifecycle_state"):
            group.states()
        for actor in actors[:2]:
            ray.kill(actor)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
