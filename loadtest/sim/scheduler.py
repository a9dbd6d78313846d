"""vLLM V1's scheduling decisions as a pure step function over plain data (no clock, no I/O).

:class:`Scheduler` decides each step the way ``vllm/v1/core/sched/scheduler.py`` does:

1. Running requests first, in order: each gets the tokens it still needs (one for a decode, the
   rest of its prompt for a chunked prefill), capped by ``long_prefill_token_threshold`` and by
   what is left of the step's token budget (``max_num_batched_tokens``). If its KV blocks cannot
   be allocated, the lowest-priority running request (FCFS: the last admitted) is preempted:
   its blocks are freed, its progress dropped (recompute), and it goes back to the front of
   the waiting queue.
2. Then, if nothing was preempted, waiting requests in queue order (FCFS, or ``priority``
   then arrival) while the budget, ``max_num_seqs`` and free blocks allow. A request's cached
   prefix (full blocks only, at most all tokens but one) is skipped. Without chunked prefill a
   prompt that does not fit in the rest of the budget waits for the next step; admission stops
   at the first request that cannot be admitted.

A step lasts ``step_fixed_s + decode_per_seq_s x requests in the batch + prefill_per_token_s x
prefill tokens computed``. At its end every request whose tokens are all computed samples one
token (the first token comes with the step that finishes the prefill).

:func:`replay` runs it in virtual time, for tests and for fitting the step costs.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .generate import Output
from .kvcache import NO_HASH, BlockPool, block_hash
from .settings import SimSettings


@dataclass(eq=False)
class EngineRequest:
    """One sequence in the engine (a request with ``n`` > 1 is ``n`` of these, as in V1)."""

    id: str
    prompt: list[int]
    output: Output
    priority: int = 0
    arrival: float = 0.0  # when the API server received it (vLLM's arrival_time)
    max_tokens: int = 0
    params_n: int = 1  # the HTTP request's n, for vllm:request_params_n
    notify: Callable[[], None] | None = None  # wakes whoever streams this request
    token_times: list[float] | None = None  # every token's time, when a caller wants them

    tokens: list[int] = field(init=False)  # prompt + generated so far
    num_computed: int = 0  # tokens whose KV is in the cache
    blocks: list[int | None] = field(default_factory=list)  # held blocks: hash if cached
    hashes: list[int] = field(default_factory=list)  # chained hashes of full token blocks
    registered: int = 0  # leading blocks already offered to the prefix cache
    state: str = "new"  # new, waiting, running, finished
    seq: int = 0  # arrival order, the last tie-break
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prefix hit at first admission
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    last_itl: float = 0.0  # gap before the latest token
    finished_at: float | None = None
    finish_reason: str | None = None  # stop, length, abort, error
    error: str | None = None  # set when the engine failed the request

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def num_output(self) -> int:
        return len(self.output.ids)

    @property
    def done(self) -> bool:
        return self.state == "finished"


class _Waiting:
    """The waiting queue: arrival order (FCFS) or (priority, arrival) order."""

    def __init__(self, by_priority: bool) -> None:
        self._by_priority = by_priority
        self._fifo: deque[EngineRequest] = deque()
        self._sorted: list[tuple[int, float, int, EngineRequest]] = []

    def __len__(self) -> int:
        return len(self._sorted) if self._by_priority else len(self._fifo)

    def __iter__(self) -> Iterator[EngineRequest]:
        return (e[3] for e in self._sorted) if self._by_priority else iter(self._fifo)

    def push(self, req: EngineRequest, *, front: bool = False) -> None:
        if self._by_priority:
            bisect.insort(self._sorted, (req.priority, req.arrival, req.seq, req))
        elif front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)

    def peek(self) -> EngineRequest:
        return self._sorted[0][3] if self._by_priority else self._fifo[0]

    def pop(self) -> EngineRequest:
        return self._sorted.pop(0)[3] if self._by_priority else self._fifo.popleft()

    def remove(self, req: EngineRequest) -> None:
        if self._by_priority:
            self._sorted = [e for e in self._sorted if e[3] is not req]
        else:
            self._fifo.remove(req)


@dataclass
class StepPlan:
    items: list[tuple[EngineRequest, int]] = field(default_factory=list)  # (request, tokens)
    prefill_tokens: int = 0
    preempted: int = 0
    cache_queries: int = 0  # tokens looked up in the prefix cache this step
    cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


@dataclass
class StepResult:
    produced: list[EngineRequest] = field(default_factory=list)  # got a token this step
    first: list[EngineRequest] = field(default_factory=list)  # got their first token
    finished: list[EngineRequest] = field(default_factory=list)


class Scheduler:
    """vLLM V1's scheduling decisions over plain data; no clock of its own, no I/O."""

    def __init__(self, settings: SimSettings) -> None:
        self.s = settings
        self.bs = settings.block_size
        self.pool = BlockPool(settings.num_gpu_blocks, self.bs, settings.enable_prefix_caching)
        self.waiting = _Waiting(settings.scheduling_policy == "priority")
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0
        self._seq = 0

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def add(self, req: EngineRequest) -> None:
        self._seq += 1
        req.seq = self._seq
        req.state = "waiting"
        self.waiting.push(req)

    def abort(self, req: EngineRequest) -> bool:
        """Drop a request wherever it is; True if the engine held it."""
        if req.state == "waiting":
            self.waiting.remove(req)
        elif req.state == "running":
            self.running.remove(req)
            self._free(req)
        else:
            return False
        req.state = "finished"
        req.finish_reason = "abort"
        return True

    def drain(self) -> list[EngineRequest]:
        """Remove every request (the engine died); return them."""
        reqs = [*self.running, *self.waiting]
        for req in self.running:
            self._free(req)
        for req in reqs:
            req.state = "finished"
            req.finish_reason = "error"
        self.running = []
        self.waiting = _Waiting(self.s.scheduling_policy == "priority")
        return reqs

    # -- one step -----------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        budget = self.s.batched_tokens
        threshold = self.s.long_prefill_token_threshold
        scheduled: dict[EngineRequest, int] = {}

        for req in list(self.running):
            if budget <= 0:
                break
            if req.state != "running":  # preempted earlier in this step
                continue
            n = len(req.tokens) - req.num_computed
            if threshold and n > threshold:
                n = threshold
            n = min(n, budget)
            while not self.pool.allocate(self._blocks_needed(req, n)):
                victim = self._victim()
                self._preempt(victim)
                plan.preempted += 1
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                if victim is req:
                    break
            if req.state != "running":
                continue
            self._add_blocks(req, n)
            scheduled[req] = n
            budget -= n

        while (
            not plan.preempted
            and budget > 0
            and len(self.waiting) > 0
            and len(self.running) < self.s.max_num_seqs
        ):
            req = self.waiting.peek()
            hits = self._cached_prefix(req)
            computed = len(hits) * self.bs
            n = len(req.tokens) - computed
            if not self.s.enable_chunked_prefill and n > budget:
                break
            if threshold and n > threshold:
                n = threshold
            n = min(n, budget)
            new_blocks = -(-(computed + n) // self.bs) - len(hits)
            if self.pool.free < new_blocks + self.pool.cost_of_hits(hits):
                break
            self.waiting.pop()
            self.pool.take_cached(hits)
            self.pool.allocate(new_blocks)
            req.blocks = [*hits, *([None] * new_blocks)]
            req.registered = len(hits)
            req.num_computed = computed
            plan.cache_queries += len(req.tokens)
            plan.cache_hits += computed
            if req.num_cached_tokens is None:
                req.num_cached_tokens = computed
            if req.scheduled_at is None:
                req.scheduled_at = now
            req.state = "running"
            self.running.append(req)
            self._register_blocks(req, computed + n)
            scheduled[req] = n
            budget -= n

        for req, n in scheduled.items():
            plan.items.append((req, n))
            if not (n == 1 and req.num_computed >= req.num_prompt):
                plan.prefill_tokens += n
        return plan

    def step_time(self, plan: StepPlan) -> float:
        s = self.s
        return (
            s.step_fixed_s
            + s.decode_per_seq_s * len(plan.items)
            + s.prefill_per_token_s * plan.prefill_tokens
        )

    def complete(self, plan: StepPlan, now: float) -> StepResult:
        """Apply a step's work: advance computed tokens, sample, finish."""
        result = StepResult()
        for req, n in plan.items:
            if req.state != "running":  # aborted or preempted while the step ran
                continue
            req.num_computed += n
            if req.num_computed < len(req.tokens):
                continue  # a prefill chunk: no token yet
            last = req.output.advance()
            req.tokens.append(req.output.ids[-1])
            if req.first_token_at is None:
                req.first_token_at = now
                result.first.append(req)
            else:
                req.last_itl = now - req.last_token_at  # type: ignore[operator]
            req.last_token_at = now
            if req.token_times is not None:
                req.token_times.append(now)
            result.produced.append(req)
            if last:
                self.running.remove(req)
                self._free(req)
                req.state = "finished"
                req.finish_reason = req.output.finish_reason
                req.finished_at = now
                result.finished.append(req)
        return result

    # -- blocks -------------------------------------------------------------------------------

    def _blocks_needed(self, req: EngineRequest, n: int) -> int:
        return -(-(req.num_computed + n) // self.bs) - len(req.blocks)

    def _add_blocks(self, req: EngineRequest, n: int) -> None:
        req.blocks.extend([None] * self._blocks_needed(req, n))
        self._register_blocks(req, req.num_computed + n)

    def _hashes(self, req: EngineRequest, full_blocks: int) -> list[int]:
        hashes = req.hashes
        bs = self.bs
        for i in range(len(hashes), full_blocks):
            hashes.append(
                block_hash(hashes[-1] if hashes else NO_HASH, req.tokens[i * bs : i * bs + bs])
            )
        return hashes

    def _cached_prefix(self, req: EngineRequest) -> list[int]:
        if not self.pool.caching:
            return []
        # At least one token must be computed, so the last token never counts as a hit.
        hashes = self._hashes(req, (len(req.tokens) - 1) // self.bs)
        return hashes[: self.pool.cached_prefix(hashes)]

    def _register_blocks(self, req: EngineRequest, num_tokens: int) -> None:
        """Cache the blocks that the scheduled tokens fill (vLLM caches at scheduling)."""
        if not self.pool.caching:
            return
        full = num_tokens // self.bs
        if full <= req.registered:
            return
        hashes = self._hashes(req, full)
        events = self.pool.events
        run: list[int] = []  # consecutive blocks newly cached: one BlockStored, as vLLM sends
        for i in range(req.registered, full):
            if req.blocks[i] is None and self.pool.register(hashes[i]):
                req.blocks[i] = hashes[i]
                if events is not None:
                    run.append(i)
            elif run and events is not None:
                events.append(self._stored(req, hashes, run))
                run = []
        if run and events is not None:
            events.append(self._stored(req, hashes, run))
        req.registered = full

    def _stored(self, req: EngineRequest, hashes: list[int], run: list[int]) -> tuple[Any, ...]:
        bs, first = self.bs, run[0]
        parent = hashes[first - 1] if first else None
        tokens = req.tokens[first * bs : (run[-1] + 1) * bs]
        return ("stored", [hashes[i] for i in run], parent, list(tokens))

    def _free(self, req: EngineRequest) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.registered = 0

    def _victim(self) -> EngineRequest:
        if self.s.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival, r.seq))
        return self.running[-1]

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.state = "waiting"
        self.waiting.push(req, front=True)


def replay(
    settings: SimSettings, arrivals: Iterable[tuple[float, EngineRequest]]
) -> tuple[Scheduler, list[StepPlan]]:
    """Run the scheduler in virtual time (no sleeping): arrivals at their times, each step as
    long as :meth:`Scheduler.step_time` says. Requests come back with their timings filled in.
    Used by tests and to fit the step costs."""
    sched = Scheduler(settings)
    pending = sorted(arrivals, key=lambda a: a[0])
    steps: list[StepPlan] = []
    now = 0.0
    i = 0
    while i < len(pending) or sched.has_work():
        while i < len(pending) and pending[i][0] + settings.request_overhead_s <= now:
            sched.add(pending[i][1])
            i += 1
        if not sched.has_work():
            now = pending[i][0] + settings.request_overhead_s
            continue
        plan = sched.schedule(now)
        if not plan.items:
            raise RuntimeError("the scheduler stalled with work queued")
        now += sched.step_time(plan)
        sched.complete(plan, now)
        steps.append(plan)
    return sched, steps
