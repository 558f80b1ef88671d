"""The simulator's radix cache on a plain model, over HTTP: reuse, the `#cached-token` log field, the
`sglang:cache_hit_rate` gauge, cached tokens counting as free, LRU eviction under KV pressure, and the
request list of the observation record."""

from __future__ import annotations

import asyncio
import hashlib
import re

import httpx
import pytest

from sglang_sim.profiles import get_profile
from tests.simproc import SimProc, run_sim_cli, start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50", "SGLANG_SIM_PROFILE": "tiny-plain"}


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def gen(sim: SimProc, text: str, max_new: int = 4, **body: object) -> dict:
    r = httpx.post(sim.url + "/generate", timeout=60, json={
        "text": text, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}, **body})
    assert r.status_code == 200, r.text
    return r.json()


def gauge(sim: SimProc, name: str) -> float:
    text = httpx.get(sim.url + "/metrics").text
    m = re.search(rf"^sglang:{name}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def prefill_lines(sim: SimProc) -> list[tuple[int, int]]:
    """(#new-token, #cached-token) of every Prefill batch line of a one-word-per-probe-free log."""
    return [(int(a), int(b)) for a, b in re.findall(r"Prefill batch, #new-seq: 1, #new-token: (\d+), "
                                                   r"#cached-token: (\d+), token usage", sim.logs())]


def test_a_repeated_long_prompt_reuses_all_but_its_last_token_in_meta_log_and_metric() -> None:
    prompt = words("p", 600)
    with start_sim("--enable-metrics", env=FAST) as sim:
        first = gen(sim, prompt)
        assert first["meta_info"]["cached_tokens"] == 0
        assert gauge(sim, "cache_hit_rate") == 0.0
        second = gen(sim, prompt)
        # the match stops one token short of the prompt (the last token is recomputed for its logits)
        assert second["meta_info"]["cached_tokens"] == 599
        assert gauge(sim, "cache_hit_rate") == 599 / 600
        assert (1, 599) in prefill_lines(sim)
        shared = gen(sim, words("p", 500) + " " + words("other", 100))
        assert shared["meta_info"]["cached_tokens"] == 500
        assert gauge(sim, "cache_hit_rate") == 500 / 600
        assert (100, 500) in prefill_lines(sim)
        # the counters: prompt tokens at their prefill, cached tokens of finished requests
        assert gauge(sim, "prompt_tokens_total") == 1800
        assert gauge(sim, "cached_tokens_total") == 1099
        assert sim.observed()["cached_tokens_total"] == 1099


def test_a_match_is_cut_to_whole_pages_of_page_size() -> None:
    with start_sim("--page-size", "16", env=FAST) as sim:
        gen(sim, words("p", 600))
        assert gen(sim, words("p", 600))["meta_info"]["cached_tokens"] == 592  # 599 cut to pages of 16
        assert gen(sim, words("p", 500) + " " + words("x", 9))["meta_info"]["cached_tokens"] == 496


def test_no_buffer_with_pages_wider_than_a_token_fails_at_start_up_as_0_5_23_does() -> None:
    p = run_sim_cli("--model-path", "sim/model", "--mamba-radix-cache-strategy", "no_buffer",
                    "--disable-overlap-schedule", "--page-size", "16", env={"SGLANG_SIM_PROFILE": "tiny-hybrid"})
    assert p.returncode == 1
    assert p.stderr.rstrip().endswith("AssertionError: no_buffer only supports page_size=1.")


def test_prefill_time_grows_with_the_uncached_tokens_only() -> None:
    """One output token: the request's latency is its prefill (model seconds, tiny-plain's cost model)."""
    prof = get_profile("tiny-plain")
    with start_sim(env=FAST) as sim:
        cold = gen(sim, words("p", 3000), max_new=1)["meta_info"]["e2e_latency"]
        warm = gen(sim, words("p", 3000), max_new=1)["meta_info"]["e2e_latency"]
        half = gen(sim, words("p", 1500) + " " + words("x", 1500), max_new=1)["meta_info"]["e2e_latency"]
    assert cold == pytest.approx(prof.prefill_s(3000), abs=2e-6)
    assert warm == pytest.approx(prof.prefill_s(1), abs=2e-6)
    assert half == pytest.approx(prof.prefill_s(1500), abs=2e-6)


def test_cached_tokens_no_request_holds_count_as_free_in_token_usage() -> None:
    with start_sim("--enable-metrics", env=FAST) as sim:
        gen(sim, words("p", 900), max_new=8)
        assert gauge(sim, "token_usage") == 0.0
        assert gauge(sim, "num_used_tokens") == 0.0
        assert gen(sim, words("p", 900))["meta_info"]["cached_tokens"] == 899  # still cached


def test_disable_radix_cache_reuses_nothing() -> None:
    prompt = words("p", 600)
    with start_sim("--enable-metrics", "--disable-radix-cache", env=FAST) as sim:
        gen(sim, prompt)
        again = gen(sim, prompt)
        assert again["meta_info"]["cached_tokens"] == 0
        assert gauge(sim, "cache_hit_rate") == 0.0
        assert (600, 0) in prefill_lines(sim) and all(cached == 0 for _, cached in prefill_lines(sim))


def test_kv_pressure_evicts_the_least_recently_used_cached_prompt_and_retracts_nothing() -> None:
    """A 3000-token pool holds two cached 600-token prompts; a 1900-token request then needs room. The
    least recently used prompt is evicted whole (its re-run reuses nothing), the other stays, and no
    request is retracted."""
    old, recent = words("old", 600), words("new", 600)
    with start_sim("--enable-metrics", "--max-total-tokens", "3000", env=FAST) as sim:
        gen(sim, old, max_new=2)
        gen(sim, recent, max_new=2)
        assert gen(sim, recent, max_new=2)["meta_info"]["cached_tokens"] == 599  # touched: most recent
        big = gen(sim, words("big", 1900), max_new=250)
        assert big["meta_info"]["completion_tokens"] == 250
        assert gen(sim, recent, max_new=2)["meta_info"]["cached_tokens"] == 599
        assert gauge(sim, "cache_hit_rate") == 599 / 600
        assert gen(sim, old, max_new=2)["meta_info"]["cached_tokens"] == 0
        assert gauge(sim, "cache_hit_rate") == 0.0
        assert gauge(sim, "num_retracted_requests_total") == 0.0
        assert "Retract requests" not in sim.logs()


def test_cached_tokens_are_free_to_admission_so_concurrent_requests_evict_them_instead_of_waiting() -> None:
    """With 2100 cached tokens in a 3000-token pool, two 1200-token requests run at once (the cache is
    evicted for them) and neither is retracted."""
    with start_sim("--enable-metrics", "--max-total-tokens", "3000", env=FAST) as sim:
        gen(sim, words("a", 1000), max_new=10)
        gen(sim, words("b", 1100), max_new=2)

        async def two() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as c:
                return list(await asyncio.gather(*(c.post(sim.url + "/generate", json={
                    "text": words(tag, 1200), "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
                    for tag in ("c", "d"))))

        assert all(r.status_code == 200 for r in asyncio.run(two()))
        assert sim.observed()["peak_running"] == 2
        assert gauge(sim, "num_retracted_requests_total") == 0.0
        assert gen(sim, words("a", 1000))["meta_info"]["cached_tokens"] == 0


def head_hash(text: str) -> str:
    return hashlib.sha1(" ".join(text.split()[:32]).encode()).hexdigest()[:12]


def test_the_record_lists_each_client_request_with_what_it_reused_when_asked() -> None:
    a, b = words("s", 400) + " one", words("s", 400) + " two three"
    with start_sim(env={**FAST, "SGLANG_SIM_RECORD_REQUESTS": "1"}) as sim:
        gen(sim, a, rid="r-a")
        assert httpx.get(sim.url + "/health_generate").status_code == 200
        gen(sim, b, rid="r-b")
        obs = sim.observed()
        assert obs["requests"] == [["r-a", 401, 0, head_hash(a)], ["r-b", 402, 400, head_hash(b)]]
        assert (obs["prompt_tokens_total"], obs["cached_tokens_total"]) == (803, 400)
    assert sim.record()["requests"] == obs["requests"]


def test_the_record_lists_no_requests_unless_asked() -> None:
    with start_sim(env=FAST) as sim:
        gen(sim, words("s", 10))
        obs = sim.observed()
        assert "requests" not in obs
        assert (obs["prompt_tokens_total"], obs["cached_tokens_total"]) == (10, 0)
