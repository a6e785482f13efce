"""Engine replicas on a local Ray instance (`--data-parallel-size 2`): prefix routing keeps a
shared-prefix workload's prompts cached where round robin thrashes the pools, `/metrics` and
`/v1/replicas` show each replica, and a killed replica fails only its own requests, by name.

Two replicas of the random `tiny` model, each with a pool of 200 blocks: room for two of the
workload's four system prompts (80 blocks each), not for all four."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import ray  # must run, never skip: `make setup` installs the `ray` extra
import uvicorn
import websockets
import websockets.sync.client as websockets_sync
from ray_replica_support import BLOCK, POOL_BLOCKS, slow_tiny_engine

from minivllm.engine.api import ReplicaSet
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams
from minivllm.server.app import create_app
from minivllm.server.config import ServerConfig

pytestmark = pytest.mark.slow
SYSTEM_BLOCKS = 80  # two system prompts fit a replica's pool (ray_replica_support.POOL_BLOCKS), four do not
MAX_TOKENS = 1200  # two such requests fit one replica's pool


@pytest.fixture(scope="module")
def replicas():
    # the workers import the engine builder from tests/, like this module does
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    replica_set = ReplicaSet.launch(2, slow_tiny_engine)
    yield replica_set
    replica_set.shutdown()
    ray.shutdown()


def shared_prefix_workload(seed: int, systems: int = 4, turns: int = 20) -> list[list[int]]:
    """`systems` system prompts of 80 blocks, each followed by `turns` distinct 8-token user turns,
    in a seeded random order (a fixed order would let round robin pin each prompt to one replica)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(SYSTEM_BLOCKS * BLOCK)] for _ in range(systems)]
    work = [p + [rng.randrange(1000, 40000) for _ in range(8)] for p in prompts for _ in range(turns)]
    rng.shuffle(work)
    return work


async def prefix_hit_rate(replica_set: ReplicaSet, work: list[list[int]], tag: str) -> float:
    """Prompt tokens found cached over prompt tokens looked up, summed over the replicas' own
    counters, for `work` run one request at a time."""
    before = dict(await replica_set.replica_stats())
    for i, ids in enumerate(work):
        async for _ in replica_set.generate(None, SamplingParams(max_tokens=1), f"{tag}-{i}", ids):
            pass
    after = dict(await replica_set.replica_stats())
    hits = sum(after[i].prefix_cache_hits - before[i].prefix_cache_hits for i in after)
    queries = sum(after[i].prefix_cache_queries - before[i].prefix_cache_queries for i in after)
    return hits / queries


def test_prefix_routing_keeps_shared_prefixes_cached_where_round_robin_does_not(replicas):
    infos = ray.get([r.handle.describe.remote() for r in replicas.replicas])
    round_robin = ReplicaSet([r.handle for r in replicas.replicas], infos, policy="round_robin")
    by_prefix = asyncio.run(prefix_hit_rate(replicas, shared_prefix_workload(seed=1), "prefix"))
    in_turn = asyncio.run(prefix_hit_rate(round_robin, shared_prefix_workload(seed=2), "rr"))
    print(f"prefix hit rate: prefix routing {by_prefix:.3f}, round robin {in_turn:.3f}")
    assert by_prefix >= 0.90
    assert 0.25 <= in_turn <= 0.75
    reasons = [d.reason for d in replicas.router.decisions]
    assert reasons.count("prefix") >= 45 and set(reasons) <= {"prefix", "least_loaded"}
    assert {d.replica for d in replicas.router.decisions} == {0, 1}  # the prompts spread over both


def long_request(tag: str, stream: bool) -> dict:
    rng = random.Random(tag)
    return {
        "prompt": [rng.randrange(1000, 40000) for _ in range(40)],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
        "request_id": tag,
    }


async def streamed(client, tag: str) -> tuple[int, list[dict]]:
    response = await client.post("/v1/completions", json=long_request(tag, True))  # read whole
    lines = response.text.splitlines()
    return response.status_code, [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


async def generating(handle, requests: int, tokens_before: int) -> None:
    """Until the replica runs `requests` requests and has generated tokens for them (so their first
    outputs reached the server): they are in flight, with a thousand tokens still to go."""
    while True:
        stats = await handle.stats.remote()
        if stats.num_running == requests and stats.generation_tokens - tokens_before >= 20 * requests:
            return
        await asyncio.sleep(0.01)


async def plain(client, tag: str) -> tuple[int, dict]:
    response = await client.post("/v1/completions", json=long_request(tag, False))
    return response.status_code, response.json()


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def routed_to(replica_set: ReplicaSet, tags) -> dict[str, int]:
    return {d.request_id: d.replica for d in replica_set.router.decisions if d.request_id in tags}


@contextlib.contextmanager
def serving(app):
    """The app under uvicorn on a thread (requests run concurrently, as in `minivllm serve`)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_the_server_shows_replicas_and_a_killed_one_fails_only_its_requests(replicas):
    app = create_app(ServerConfig(engine=replicas))

    async def scenario(base_url: str):
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            listed = (await client.get("/v1/replicas")).json()
            assert [(r["id"], r["alive"]) for r in listed["replicas"]] == [(0, True), (1, True)]
            assert listed["policy"] == "prefix"
            metrics = (await client.get("/metrics")).text
            for replica in ("0", "1"):
                assert f'replica="{replica}"' in metrics
            assert 'minivllm:prefix_cache_hits_total{model_name="random:tiny",replica="0"}' in metrics

            doomed = replicas.replicas[1].handle
            tokens_before = (await doomed.stats.remote()).generation_tokens
            tasks = {
                "s0": asyncio.ensure_future(streamed(client, "s0")),
                "s1": asyncio.ensure_future(streamed(client, "s1")),
                "p0": asyncio.ensure_future(plain(client, "p0")),
                "p1": asyncio.ensure_future(plain(client, "p1")),
            }
            await asyncio.wait_for(until(lambda: len(routed_to(replicas, tasks)) == 4), 60)
            where = routed_to(replicas, tasks)
            assert sorted(where.values()) == [0, 0, 1, 1], where  # least loaded: two on each
            await asyncio.wait_for(generating(doomed, 2, tokens_before), 60)
            ray.kill(doomed)
            results = {tag: await task for tag, task in tasks.items()}

            for tag, replica in where.items():
                status, body = results[tag]
                if tag.startswith("s"):
                    assert status == 200
                    final = body[-1]
                    if replica == 1:  # the stream ends with an error event that names the replica
                        assert final["error"]["code"] == "engine_dead" and "replica 1" in final["error"]["message"]
                    else:
                        assert len(body) > 100 and final["choices"][0]["finish_reason"] == "length"
                elif replica == 1:
                    assert status == 503 and body["error"]["code"] == "engine_dead"
                    assert "replica 1" in body["error"]["message"] and tag in body["error"]["message"]
                else:
                    assert status == 200 and body["usage"]["completion_tokens"] == MAX_TOKENS

            after = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
            assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
            listed = (await client.get("/v1/replicas")).json()
            assert [(r["id"], r["alive"]) for r in listed["replicas"]] == [(0, True), (1, False)]
            assert "replica 1" in listed["replicas"][1]["dead_reason"]
            last = listed["decisions"][-1]
            assert (last["replica"], last["reason"], last["prompt_blocks"]) == (0, "least_loaded", 0)
            assert 'replica="1"' not in (await client.get("/metrics")).text

    with serving(app) as base_url:
        ws_url = base_url.replace("http://", "ws://") + "/ws/events"
        for replica in (0, 1):  # the dashboard follows one replica's events at a time
            with websockets_sync.connect(f"{ws_url}?replica={replica}", max_size=None) as socket:
                first = msgspec.json.decode(socket.recv(timeout=30), type=ev.WsMessage)
                assert isinstance(first, ev.Snapshot) and first.config.num_blocks == POOL_BLOCKS
        with websockets_sync.connect(f"{ws_url}?replica=2") as socket:
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                socket.recv(timeout=30)
        assert closed.value.rcvd.code == 4400 and "replica must be in 0..1" in closed.value.rcvd.reason
        asyncio.run(scenario(base_url))
