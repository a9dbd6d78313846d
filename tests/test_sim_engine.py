"""The scheduler and KV block pool in virtual time: vLLM V1's decisions, no sleeping."""

from __future__ import annotations

import pytest

from loadtest.bench_sim import HTTP_OVERHEAD_MS, PUBLISHED
from loadtest.bench_sim import model as bench_model
from loadtest.sim.generate import Output
from loadtest.sim.kvcache import BlockPool
from loadtest.sim.scheduler import EngineRequest, Scheduler, replay
from loadtest.sim.settings import SettingsError, SimSettings, validated

BASE = SimSettings(request_overhead_s=0.0)


def _req(name: str, prompt: list[int], max_tokens: int, *, at: float = 0.0, priority: int = 0):
    return EngineRequest(
        id=name, prompt=prompt, output=Output(hash(name) & 0xFFFF, max_tokens=max_tokens),
        priority=priority, arrival=at, max_tokens=max_tokens, token_times=[],
    )  # fmt: skip


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _ttft(req: EngineRequest) -> float:
    assert req.first_token_at is not None
    return req.first_token_at - req.arrival


def _small_ttft(settings: SimSettings, *, with_big: bool) -> tuple[float, float]:
    """TTFT of a 128-token request arriving 1 ms after a 2048-token one (or alone), and the
    time of the run's longest step (the one with the most prefill tokens)."""
    small = _req("small", _tokens(100_000, 128), 16, at=0.001)
    arrivals = [(0.001, small)]
    if with_big:
        arrivals.append((0.0, _req("big", _tokens(0, 2048), 64)))
    _, steps = replay(settings, arrivals)
    longest = max(steps, key=lambda p: p.prefill_tokens)
    return _ttft(small), Scheduler(settings).step_time(longest)


def test_chunked_prefill_off_long_prompt_delays_short_request_by_its_prefill_time():
    s = BASE.replace(enable_chunked_prefill=False)
    alone, _ = _small_ttft(s, with_big=False)
    behind, prefill_step = _small_ttft(s, with_big=True)
    assert prefill_step > 5 * alone  # the 2048-token prefill is the long part
    assert 0.9 * prefill_step <= behind - alone <= 1.1 * prefill_step


def test_chunked_prefill_on_short_request_waits_at_most_about_one_step():
    # vLLM V1 schedules running requests first, so without a per-request cap a long prefill
    # takes the whole budget every step; the cap leaves room for the short request.
    s = BASE.replace(max_num_batched_tokens=512, long_prefill_token_threshold=256)
    alone, _ = _small_ttft(s, with_big=False)
    behind, longest_step = _small_ttft(s, with_big=True)
    assert behind - alone <= 1.2 * longest_step


def test_chunked_prefill_without_threshold_long_prompt_takes_every_budget_first():
    s = BASE.replace(max_num_batched_tokens=512)  # vLLM's default: no threshold
    alone, _ = _small_ttft(s, with_big=False)
    behind, _ = _small_ttft(s, with_big=True)
    one_step = Scheduler(s).step_time(replay(s, [(0.0, _req("x", _tokens(0, 512), 1))])[1][0])
    assert behind - alone > 2.5 * one_step  # waits for most of the 4 prefill chunks


def test_repeated_prefix_hits_the_cache_and_shortens_ttft():
    prefix = _tokens(0, 1024)
    first = _req("first", [*prefix, *_tokens(50_000, 64)], 8)
    second = _req("second", [*prefix, *_tokens(60_000, 64)], 8, at=1.0)
    _, steps = replay(BASE, [(0.0, first), (1.0, second)])
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 1024  # 64 full blocks
    assert sum(p.cache_hits for p in steps) == 1024
    assert sum(p.cache_queries for p in steps) == len(first.prompt) + len(second.prompt)
    assert _ttft(second) < 0.5 * _ttft(first)


def test_prefix_caching_off_never_hits():
    s = BASE.replace(enable_prefix_caching=False)
    prefix = _tokens(0, 1024)
    second = _req("second", [*prefix, 7], 4, at=1.0)
    replay(s, [(0.0, _req("first", [*prefix, 8], 4)), (1.0, second)])
    assert second.num_cached_tokens == 0


def test_max_num_seqs_caps_running_and_the_rest_wait():
    sched = Scheduler(BASE.replace(max_num_seqs=2))
    for i in range(5):
        sched.add(_req(f"r{i}", _tokens(i * 1000, 50), 4))
    now = 0.0
    while sched.has_work():
        plan = sched.schedule(now)
        assert len(sched.running) <= 2
        assert len(plan.items) <= 2
        now += sched.step_time(plan)
        sched.complete(plan, now)
        if now < 0.02:
            assert len(sched.waiting) == 3


def test_token_budget_caps_every_step():
    s = BASE.replace(max_num_batched_tokens=300)
    reqs = [(0.0, _req(f"r{i}", _tokens(i * 1000, 200), 8)) for i in range(3)]
    _, steps = replay(s, reqs)
    assert steps[0].num_tokens == 300  # 200 + a 100-token chunk of the second prompt
    assert all(p.num_tokens <= 300 for p in steps)
    assert all(r.num_output == 8 for _, r in reqs)


def test_exhausted_kv_blocks_preempt_and_every_request_still_completes():
    s = BASE.replace(num_gpu_blocks=40, max_model_len=512, block_size=16)
    reqs = [(0.0, _req(f"r{i}", _tokens(i * 1000, 100), 300)) for i in range(4)]
    sched, steps = replay(s, reqs)
    assert sched.num_preemptions > 0
    assert sum(p.preempted for p in steps) == sched.num_preemptions
    assert all(r.num_output == 300 and r.finish_reason == "length" for _, r in reqs)
    assert any(r.num_preemptions for _, r in reqs)
    assert sched.pool.in_use == 0  # everything released at the end


def test_priority_policy_admits_lower_values_first():
    s = BASE.replace(scheduling_policy="priority", max_num_seqs=1)
    first = _req("first", _tokens(0, 20), 10)
    late = [_req("b", _tokens(1000, 20), 2, at=0.001, priority=5),
            _req("c", _tokens(2000, 20), 2, at=0.002, priority=1),
            _req("d", _tokens(3000, 20), 2, at=0.003, priority=1)]  # fmt: skip
    replay(s, [(0.0, first), *((r.arrival, r) for r in late)])
    order = sorted(late, key=lambda r: r.scheduled_at or 0)
    assert [r.id for r in order] == ["c", "d", "b"]


def test_fcfs_policy_admits_in_arrival_order_whatever_the_priority():
    s = BASE.replace(max_num_seqs=1)
    late = [_req("b", _tokens(1000, 20), 2, at=0.001, priority=5),
            _req("c", _tokens(2000, 20), 2, at=0.002, priority=1)]  # fmt: skip
    replay(s, [(0.0, _req("first", _tokens(0, 20), 10)), *((r.arrival, r) for r in late)])
    assert late[0].scheduled_at < late[1].scheduled_at  # type: ignore[operator]


def test_abort_releases_a_running_requests_blocks():
    sched = Scheduler(BASE)
    req = _req("r", _tokens(0, 100), 50)
    sched.add(req)
    sched.complete(sched.schedule(0.0), 0.01)
    assert sched.pool.in_use == 7  # 101 tokens in 16-token blocks
    assert sched.abort(req) and req.finish_reason == "abort"
    assert sched.pool.in_use == 0 and not sched.running
    assert not sched.abort(req)


def test_step_time_is_fixed_plus_per_request_plus_per_prefill_token():
    s = BASE.replace(step_fixed_s=0.004, decode_per_seq_s=0.001, prefill_per_token_s=0.0001)
    sched = Scheduler(s)
    sched.add(_req("a", _tokens(0, 100), 5))
    sched.add(_req("b", _tokens(1000, 50), 5))
    plan = sched.schedule(0.0)
    assert sched.step_time(plan) == pytest.approx(0.004 + 2 * 0.001 + 150 * 0.0001)
    sched.complete(plan, 1.0)
    decode = sched.schedule(1.0)
    assert decode.prefill_tokens == 0
    assert sched.step_time(decode) == pytest.approx(0.004 + 2 * 0.001)


def test_block_pool_evicts_least_recently_freed_cached_blocks():
    pool = BlockPool(num_blocks=4, block_size=16, caching=True)
    assert pool.allocate(3)
    for h in (11, 12, 13):
        assert pool.register(h)
    assert not pool.register(11)  # a duplicate stays private
    pool.release([11, 12, 13])  # freed in reverse: 13 is evicted first, then 12
    assert pool.free == 4 and pool.cached_blocks == 3 and pool.usage == 0
    assert pool.cached_prefix([11, 12, 13, 14]) == 3
    assert pool.allocate(2)  # one never-used block, then evicts 13
    assert pool.cached_prefix([11, 12, 13]) == 2
    assert pool.cost_of_hits([11, 12]) == 2
    pool.take_cached([11, 12])
    assert pool.free == 0 and not pool.allocate(1)


def test_settings_reject_what_vllm_would_refuse():
    with pytest.raises(SettingsError, match="chunked prefill disabled"):
        validated(SimSettings(enable_chunked_prefill=False, max_num_batched_tokens=2048))
    with pytest.raises(SettingsError, match="cannot hold one request"):
        validated(SimSettings(num_gpu_blocks=10))
    assert SimSettings(enable_chunked_prefill=False).batched_tokens == 32768
    assert SimSettings().batched_tokens == 2048


@pytest.mark.parametrize("concurrency", sorted(PUBLISHED))
def test_default_costs_reproduce_the_published_l4_figures(concurrency):
    ttft_ms, itl_ms = bench_model(SimSettings(), concurrency, max(10, 4 * concurrency), seed=1)
    published_ttft, published_itl = PUBLISHED[concurrency]
    # The model leaves room for the HTTP path, which bench_sim measures on top of it.
    assert ttft_ms + HTTP_OVERHEAD_MS == pytest.approx(published_ttft, rel=0.1)
    assert itl_ms == pytest.approx(published_itl, rel=0.05)
