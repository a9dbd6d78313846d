"""Replay the published vLLM load against the simulator and print its figures beside the
published ones.

The reference: vLLM 0.23, Qwen/Qwen2.5-0.5B-Instruct on one NVIDIA L4, random prompts of 256
tokens, 128 output tokens, closed loop at a fixed concurrency (``vllm bench serve`` style:
every client sends its next request when the previous one ends). Published p50s: inter-token
latency 5.1 ms at concurrency 1 and 7.1 ms at 32; time to first token 27 ms at 1 and 135 ms at 32.

Columns: ``sim`` is measured over HTTP against a simulator process (started here unless
``--url`` names one); ``model`` is the scheduler alone in virtual time (what the step costs
predict, without any HTTP or event-loop overhead); ``published`` is the reference.

    python -m loadtest.bench_sim [--url URL] [--concurrency 1,2,4,8,16,32] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from loadtest.sim.generate import Output
from loadtest.sim.scheduler import EngineRequest, Scheduler
from loadtest.sim.settings import SimSettings

PROMPT_TOKENS = 256
OUTPUT_TOKENS = 128
PUBLISHED = {1: (27.0, 5.1), 32: (135.0, 7.1)}  # concurrency -> (TTFT p50 ms, ITL p50 ms)
# What the simulator's own HTTP path and timers add to the model's TTFT, as this benchmark
# measures it (request_overhead_s was fitted with this subtracted).
HTTP_OVERHEAD_MS = 3.0
VOCAB = 150_000


@dataclass
class Sample:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: bool = False


def _prompt(rng: random.Random) -> list[int]:
    # Random token ids, as vllm bench's random dataset: no two prompts share a cached block.
    return [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> Sample:
    body = {
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    sample = Sample()
    start = time.perf_counter()
    last = start
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            if sample.tokens == 0:
                sample.ttft = now - start
            else:
                sample.itls.append(now - last)
            last = now
            sample.tokens += 1
    sample.ok = sample.tokens == OUTPUT_TOKENS
    return sample


async def measure(url: str, concurrency: int, total: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    prompts = [_prompt(rng) for _ in range(total)]
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        queue = list(reversed(prompts))

        async def worker() -> None:
            while queue:
                samples.append(await _one(session, url, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


def model(settings: SimSettings, concurrency: int, total: int, seed: int) -> tuple[float, float]:
    """The same closed loop through the scheduler alone, in virtual time: (TTFT, ITL) p50 ms."""
    rng = random.Random(seed)
    sched = Scheduler(settings)
    arrivals: list[tuple[float, int]] = [(0.0, i) for i in range(concurrency)]
    sent = concurrency
    reqs: list[EngineRequest] = []
    now = 0.0
    while arrivals or sched.has_work():
        while arrivals and arrivals[0][0] + settings.request_overhead_s <= now:
            at, i = heapq.heappop(arrivals)
            req = EngineRequest(
                id=str(i), prompt=_prompt(rng), output=Output(i, max_tokens=OUTPUT_TOKENS),
                arrival=at, token_times=[],
            )  # fmt: skip
            sched.add(req)
            reqs.append(req)
        if not sched.has_work():
            now = arrivals[0][0] + settings.request_overhead_s
            continue
        plan = sched.schedule(now)
        now += sched.step_time(plan)
        for _ in sched.complete(plan, now).finished:
            if sent < total:
                heapq.heappush(arrivals, (now, sent))
                sent += 1
    ttft = [r.first_token_at - r.arrival for r in reqs if r.first_token_at is not None]
    itl = [b - a for r in reqs if r.token_times for a, b in itertools.pairwise(r.token_times)]
    return statistics.median(ttft) * 1000, statistics.median(itl) * 1000


def _start_sim() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.sim", "--port", "0", "--name", "bench",
         "--exit-on-stdin-eof"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError("the simulator did not start")
    return proc, json.loads(line)["url"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_sim", description=__doc__)
    p.add_argument("--url", help="a running simulator (default: start one with default settings)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--rounds", type=int, default=4, help="requests per client at each level")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    proc = None
    url = args.url
    if url is None:
        proc, url = _start_sim()
    settings = SimSettings()
    print(f"simulator {url}; load: {PROMPT_TOKENS} tokens in, {OUTPUT_TOKENS} out, closed loop")
    print(f"{'conc':>4} | {'TTFT p50 ms':^26} | {'ITL p50 ms':^26} | {'req/s':>6}")
    print(f"{'':>4} | {'sim':>8}{'model':>9}{'publ.':>9} | {'sim':>8}{'model':>9}{'publ.':>9} |")
    try:
        for c in levels:
            total = max(10, c * args.rounds)
            t0 = time.perf_counter()
            samples = asyncio.run(measure(url, c, total, args.seed + c))
            wall = time.perf_counter() - t0
            bad = sum(not s.ok for s in samples)
            ttft = statistics.median(s.ttft for s in samples) * 1000
            itl = statistics.median(x for s in samples for x in s.itls) * 1000
            m_ttft, m_itl = model(settings, c, total, args.seed + c)
            pub = PUBLISHED.get(c)
            pt = f"{pub[0]:9.1f}" if pub else f"{'-':>9}"
            pi = f"{pub[1]:9.1f}" if pub else f"{'-':>9}"
            note = f"  ({bad} incomplete)" if bad else ""
            print(f"{c:>4} | {ttft:8.1f}{m_ttft:9.1f}{pt} | {itl:8.1f}{m_itl:9.1f}{pi} | "
                  f"{len(samples) / wall:6.1f}{note}")  # fmt: skip
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
