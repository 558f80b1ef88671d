"""What each `--mamba-radix-cache-strategy` lets a hybrid model reuse, as SGLang 0.5.23 does it (the
match must end on a node holding a mamba state), over HTTP.

Workload, one request at a time: R0 = S + q0 (300 shared words and 20 of its own: 320 tokens),
R1 = S + q1, R2 = S + q2, then R3 = R0's prompt + R0's 8 output words + 10 new words."""

from __future__ import annotations

import httpx
import pytest

from tests.simproc import start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50"}
SHARED = " ".join(f"s{i}" for i in range(300))


def own(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def workload(url: str) -> list[int]:
    def gen(text: str) -> dict:
        r = httpx.post(url + "/generate", timeout=60, json={
            "text": text, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return r.json()

    outs = [gen(f"{SHARED} {own(f'q{k}_', 20)}") for k in range(3)]
    turn = gen(f"{SHARED} {own('q0_', 20)} {outs[0]['text']} {own('next', 10)}")
    return [o["meta_info"]["cached_tokens"] for o in [*outs, turn]]


# R1 finds the shared 300 tokens' KV but no state inside them (R0's state sits at 320), so it reuses
# nothing and tracks its state at the branching point floor(300 / 64) * 64 = 256, which R2 reuses;
# R3 reuses R0's prefill state at 320 (R0 crossed no 256-token decode boundary after its prefill).
EXTRA = [0, 0, 256, 320]
# Only sequence ends hold states: the end of R0's prefill (320) and of R0 (320 + 8 - 1 = 327).
NO_BUFFER = [0, 0, 0, 327]


@pytest.mark.parametrize(("flags", "expected"), [
    pytest.param((), EXTRA, id="auto is extra_buffer"),
    pytest.param(("--mamba-radix-cache-strategy", "extra_buffer"), EXTRA, id="extra_buffer"),
    pytest.param(("--mamba-radix-cache-strategy", "extra_buffer_lazy"), EXTRA, id="extra_buffer_lazy"),
    pytest.param(("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"), NO_BUFFER,
                 id="no_buffer"),
    pytest.param(("--disable-overlap-schedule",), NO_BUFFER, id="auto without overlap is no_buffer"),
    pytest.param(("--disable-radix-cache",), [0, 0, 0, 0], id="radix cache off"),
])
def test_each_mamba_strategy_reuses_what_sglang_0_5_23_lets_it(flags: tuple[str, ...], expected: list[int]) -> None:
    with start_sim(*flags, env=FAST) as sim:
        assert workload(sim.url) == expected
        if expected[2]:
            assert f"#cached-token: {expected[2]}, full token usage" in sim.logs()


def test_a_plain_model_reuses_the_whole_kv_match() -> None:
    with start_sim(env={**FAST, "SGLANG_SIM_PROFILE": "tiny-plain"}) as sim:
        assert workload(sim.url) == [0, 300, 300, 327]


def test_cached_mamba_states_are_evicted_least_recently_used_first_when_the_pool_is_full() -> None:
    """tiny-hybrid has 61 mamba slots. Each 130-word prompt leaves one state (at 128, the 64-token
    grid) in the tree; after 70 of them the oldest states are gone, and with them their nodes' KV (each
    is a leaf), while the latest is still reused."""
    with start_sim(env=FAST) as sim:
        def gen(k: int) -> int:
            r = httpx.post(sim.url + "/generate", timeout=60, json={
                "text": own(f"p{k}_", 130), "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]["cached_tokens"]

        assert [gen(k) for k in range(70)] == [0] * 70
        assert gen(69) == 128
        assert gen(0) == 0
