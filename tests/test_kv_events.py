"""vLLM's KV cache events end to end, over real ZMQ and HTTP sockets: the simulator publishes
them from its block pool in vLLM's wire format, and a gateway's ``cache_aware`` pool routes on
the blocks each replica really holds (precise mode), replays a gap, and falls back to its
approximate index when events stop."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from loadtest.sim.kv_events import END_SEQ
from loadtest.sim.replica import Sim
from loadtest.sim.server import run_sim
from proxy.fleet.kv_events import KvEventFeed
from proxy.routing.kv_blocks import BlockStored, decode_batch, token_block_keys

from .gateway import policy_for, running_gateway, wait_healthy
from .lost_cancel import LostCancel, ended_in_time
from .servers import FAST_SIM
from .waiting import wait_until

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
REAL = math.inf  # ``match`` at this instant counts only blocks the events stored (no speculation)


def kv_settings(encoding: str = "map", **more: Any):  # type: ignore[no-untyped-def]
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv@sim",
        "encoding": encoding,
    }
    return FAST_SIM.replace(kv_events_config=json.dumps(config), **more)


def chat(system: str, question: str, max_tokens: int = 2) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens}


SYSTEM = " ".join(f"rule {i}: keep every answer short, exact and polite." for i in range(40))


@asynccontextmanager
async def subscribed(sim: Sim) -> AsyncIterator[zmq.asyncio.Socket]:
    assert sim.kv_events is not None
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@sim")
    sub.connect(sim.kv_events.endpoint)
    try:
        yield sub
    finally:
        sub.close(linger=0)
        ctx.term()


async def render_ids(url: str, body: dict[str, Any]) -> list[int]:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["token_ids"])


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_the_simulator_publishes_vllms_kv_events(encoding: str) -> None:
    """Frames, sequence, batch and event shapes as vLLM sends them; the stored blocks' token ids
    are the prompt's own, chained by parent hash; an engine reset clears them."""
    settings = kv_settings(encoding)
    async with run_sim(settings, name="a") as sim, subscribed(sim) as sub:
        body = chat(SYSTEM, "hello")
        ids = await render_ids(sim.url, body)

        async def sent_until_received() -> list[bytes]:
            # A SUB connects in the background: resend until one batch gets through.
            while True:
                async with httpx.AsyncClient(timeout=10) as client:
                    r = await client.post(sim.url + "/v1/chat/completions", json=body)
                    assert r.status_code == 200
                try:
                    async with asyncio.timeout(1.0):
                        return list(await sub.recv_multipart())
                except TimeoutError:
                    continue

        topic, seq, payload = await sent_until_received()
        assert topic == b"kv@sim" and len(seq) == 8
        raw = msgspec.msgpack.decode(payload)
        ts, events, rank = raw
        assert isinstance(ts, float) and rank == 0
        shape = dict if encoding == "map" else list
        assert all(isinstance(e, shape) for e in events)
        if encoding == "map":
            assert events[0]["type"] == "BlockStored" and events[0]["medium"] == "GPU"
        else:
            assert events[0][0] == "BlockStored"
        (first, *_) = decode_batch(raw)
        assert isinstance(first, BlockStored) and first.block_size == 16
        assert first.parent_block_hash is None
        n = len(first.block_hashes)
        assert first.token_ids == ids[: n * 16]  # the prompt's own tokens, whole blocks
        assert all(0 <= h < 2**64 for h in first.block_hashes)
        # An engine restart (engine_dead lifted) empties the cache: AllBlocksCleared.
        await sim.set_fault({"fault": "engine_dead"})
        await sim.set_fault(None)
        async with asyncio.timeout(10):
            while True:
                batch = decode_batch(msgspec.msgpack.decode((await sub.recv_multipart())[2]))
                if any(type(e).__name__ == "AllBlocksCleared" for e in batch):
                    break


async def test_replay_streams_the_kept_batches_then_the_end_marker() -> None:
    async with run_sim(kv_settings(), name="a") as sim:
        assert sim.kv_events is not None and sim.kv_events.replay_address is not None
        async with httpx.AsyncClient(timeout=10) as client:
            for q in range(3):
                r = await client.post(sim.url + "/v1/chat/completions", json=chat(SYSTEM, f"q{q}"))
                assert r.status_code == 200
        kept = [seq for seq, _ in sim.kv_events.kept]
        assert kept == list(range(len(kept))) and kept
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(sim.kv_events.replay_address)
            await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            got = []
            async with asyncio.timeout(10):
                while True:
                    empty, seq, payload = await dealer.recv_multipart()
                    assert empty == b""
                    if seq == END_SEQ:
                        assert payload == b""
                        break
                    got.append(int.from_bytes(seq, "big"))
            assert got == kept[1:]
        finally:
            dealer.close(linger=0)
            ctx.term()


def precise_policy(sims: list[Sim], **cache_aware: Any) -> dict[str, Any]:
    policy = policy_for({"p": [s.url for s in sims]}, balance="cache_aware")
    for rc, sim in zip(policy["pools"]["p"]["replicas"], sims, strict=True):
        assert sim.kv_events is not None
        rc["kv_events"] = sim.kv_events.endpoint
        rc["kv_events_replay"] = sim.kv_events.replay_address
        rc["kv_events_topic"] = "kv@sim"
        rc["name"] = sim.settings.name
    policy["pools"]["p"]["cache_aware"] = cache_aware
    return policy


def feed_of(app: Any, sim: Sim) -> KvEventFeed:
    return next(f for (_, url), f in app.gateway.feeds.by_replica.items() if url == sim.url)


async def test_a_precise_pool_routes_on_the_blocks_each_replica_holds(access_lines) -> None:  # type: ignore[no-untyped-def]
    """The gateway's block set of each replica is the replica's own (matched by token ids), a
    repeated prefix goes where its blocks are with the exact match in tokens, and a prefix the
    replica evicted is no longer counted there."""
    async with (
        run_sim(kv_settings(), name="a") as a,
        run_sim(kv_settings(), name="b") as b,
        running_gateway(precise_policy([a, b]), ready=False) as (url, app),
    ):
        await wait_healthy(app, 2)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            first = await client.post("/v1/chat/completions", json=chat(SYSTEM, "one"))
            assert first.status_code == 200
            home = {"a": a, "b": b}[first.headers["x-tokenlane-replica"]]
            ids = await render_ids(home.url, chat(SYSTEM, "two"))
            keys = token_block_keys(ids, 16)
            feed = feed_of(app, home)
            # The replica's events arrive: its set holds the shared system prompt's blocks.
            await wait_until(lambda: feed.blocks.match(keys, REAL) >= 10, what="blocks stored")
            assert feed.blocks.orphans == 0
            held = feed.blocks.match(keys, REAL)
            second = await client.post("/v1/chat/completions", json=chat(SYSTEM, "two"))
            assert second.headers["x-tokenlane-replica"] == home.settings.name
        await wait_until(lambda: len(access_lines) >= 2, what="both access lines")
        # Matched in whole replica blocks of the rendered prompt (not the text estimate).
        assert access_lines[1]["prefix_match_tokens"] == held * 16
        other = feed_of(app, b if home is a else a)
        assert other.blocks.match(keys, REAL) == 0  # the other replica never held it


async def test_a_gap_is_replayed_and_stopped_events_fall_back_to_the_approximate_index() -> None:
    async with (
        run_sim(kv_settings(), name="a") as a,
        running_gateway(precise_policy([a], events_stale_s=0.5), ready=False) as (url, app),
    ):
        await wait_healthy(app, 1)
        assert a.kv_events is not None
        feed = feed_of(app, a)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def send(q: str) -> None:
                r = await client.post("/v1/chat/completions", json=chat(SYSTEM, q))
                assert r.status_code == 200

            await send("warm")
            await wait_until(lambda: feed.batches > 0, what="a first batch")
            # One batch lost on the wire: the next one shows the gap, the replay fills it.
            a.kv_events.drop_next = 1
            await send("gap")
            await send("after")
            await wait_until(lambda: feed.gaps_replayed == 1, what="the gap replayed")
            assert feed.gaps_lost == 0 and feed.last_seq == a.kv_events.seq - 1
            assert feed.live(time.monotonic(), 0.5)
            # Events stop (the publisher loses everything from now on): a request sent there
            # with no batch after it turns the replica's precise view off.
            a.kv_events.drop_next = 10**9
            await send("silent")

            async def fell_back() -> bool:
                text = (await client.get("/metrics")).text
                return 'tokenlane_kv_events_up{pool="p",replica="a"} 0.0' in text

            await wait_until(fell_back, what="the replica's precise view off")
            a.kv_events.drop_next = 0
            await send("again")  # its batch flows: precise again (after the replayed gap)

            async def back() -> bool:
                text = (await client.get("/metrics")).text
                return 'tokenlane_kv_events_up{pool="p",replica="a"} 1.0' in text

            await wait_until(back, what="the replica's precise view back")


async def test_an_evicted_block_is_published_as_removed_and_leaves_the_gateways_set() -> None:
    """A pool too small for two prompts: the second evicts the first's blocks (vLLM's lazy
    LRU: only when reallocated), the replica says BlockRemoved, and the gateway's set drops
    them, so the first prompt no longer matches there."""
    small = kv_settings(num_gpu_blocks=40, max_model_len=600)  # 640 tokens of KV
    other = " ".join(f"another rule {i}: say nothing you cannot prove." for i in range(40))
    async with (
        run_sim(small, name="a") as a,
        running_gateway(precise_policy([a]), ready=False) as (url, app),
    ):
        await wait_healthy(app, 1)
        feed = feed_of(app, a)
        first_keys = token_block_keys(await render_ids(a.url, chat(SYSTEM, "x")), 16)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/v1/chat/completions", json=chat(SYSTEM, "x"))
            assert r.status_code == 200
            await wait_until(lambda: feed.blocks.match(first_keys, REAL) > 10, what="stored")
            removed_before = len(feed.blocks)
            r = await client.post("/v1/chat/completions", json=chat(other, "y"))
            assert r.status_code == 200
        await wait_until(
            lambda: feed.blocks.match(first_keys, REAL) < 10, what="the first prompt evicted"
        )
        assert removed_before > 0 and feed.blocks.orphans == 0


async def test_a_restarted_replica_is_followed_from_its_new_sequence() -> None:
    """A crashed replica comes back with an empty cache, new block hashes and its batches
    numbered from 0 again: the feed forgets the old set and follows the new engine (it would
    otherwise drop every new batch as already seen and keep matching evicted prefixes)."""
    async with run_sim(kv_settings(), name="a") as a:
        assert a.kv_events is not None
        ctx = zmq.asyncio.Context()
        feed = KvEventFeed(
            "p", "a", a.kv_events.endpoint, a.kv_events.replay_address, "kv@sim", ctx
        )
        feed.start()
        try:
            old_keys = token_block_keys(await render_ids(a.url, chat(SYSTEM, "x")), 16)
            async with httpx.AsyncClient(timeout=30) as client:
                for q in ("x", "y", "z"):  # a few batches, so the old sequence is past 0
                    r = await client.post(a.url + "/v1/chat/completions", json=chat(SYSTEM, q))
                    assert r.status_code == 200
            await wait_until(lambda: feed.last_seq == a.kv_events.seq - 1, what="all applied")
            assert feed.last_seq and feed.blocks.match(old_keys, REAL) > 10
            await a.set_fault({"fault": "crash"})
            await a.set_fault(None)
            other = " ".join(f"fresh rule {i}: nothing but the truth." for i in range(40))
            new_keys = token_block_keys(await render_ids(a.url, chat(other, "w")), 16)
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.post(a.url + "/v1/chat/completions", json=chat(other, "w"))
                assert r.status_code == 200
            await wait_until(lambda: feed.blocks.match(new_keys, REAL) > 10, what="new blocks")
            assert feed.restarts == 1 and feed.blocks.match(old_keys, REAL) == 0
        finally:
            await feed.stop()
            ctx.term()


async def test_a_render_that_fails_or_hangs_costs_the_request_only_its_precise_match() -> None:
    """Refused, silent past the bound, or an error answer: no token ids, and no exception
    that could fail the client's request (the relay then routes on the approximate index)."""
    from types import SimpleNamespace

    from proxy.config import ReplicaConfig
    from proxy.fleet.kv_events import render_token_ids
    from proxy.fleet.replica import Replica
    from proxy.policyfile import build_policy
    from proxy.relay.upstream import make_client

    from .servers import free_port

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        await asyncio.sleep(3600)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    silent_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    refused_url = f"http://127.0.0.1:{free_port()}"
    body = chat(SYSTEM, "x")
    call = SimpleNamespace(kind="chat", fields=body, body=json.dumps(body).encode())
    client = make_client(build_policy(policy_for({"p": ["http://127.0.0.1:1"]})))
    try:
        async with run_sim(FAST_SIM, name="a", model="another-model") as wrong_model:
            for url in (refused_url, silent_url, wrong_model.url):
                replica = Replica(pool="p", config=ReplicaConfig(url=url), name="r", url=url)
                started = time.monotonic()
                assert await render_token_ids(client, replica, call, 0.5) is None, url  # type: ignore[arg-type]
                assert time.monotonic() - started < 30  # bounded (0.5 s, with a wide margin)
        async with run_sim(FAST_SIM, name="b") as good:
            replica = Replica(pool="p", config=ReplicaConfig(url=good.url), name="b", url=good.url)
            ids = await render_token_ids(client, replica, call, 5.0)  # type: ignore[arg-type]
            assert ids == await render_ids(good.url, body)
    finally:
        await client.aclose()
        server.close()


async def test_a_subscription_whose_cancel_a_replay_swallowed_still_stops() -> None:
    # A replay runs under ``asyncio.timeout`` and survives its TimeoutError; Python 3.11's may
    # be a cancel that landed as it expired. The subscription must end at its next batch's
    # wait, not wait there for ever (nothing is published here).
    async with run_sim(kv_settings(), name="a") as sim:
        assert sim.kv_events is not None and sim.kv_events.replay_address is not None
        ctx = zmq.asyncio.Context()
        feed = KvEventFeed(
            "p", "a", sim.kv_events.endpoint, sim.kv_events.replay_address, "kv@sim", ctx
        )
        lost = LostCancel()  # caught inside the replay, which then returns as after a timeout

        async def replay(start: int, until: int | None) -> bool:
            await lost.wait()
            return False

        feed._replay_from = replay  # type: ignore[method-assign]
        try:
            feed.start()
            await asyncio.wait_for(lost.entered.wait(), timeout=30)
            task = feed.cancel()
            assert task is not None
            ended = await ended_in_time(task)
        finally:
            ctx.term()
    assert lost.swallowed.is_set()
    assert ended, "the subscription still waited for a batch 30 s after its cancel"
    assert task.cancelled()
