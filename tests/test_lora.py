"""LoRA adapters per line (issue 30): the two ways a line names an adapter and the one form it is stored
in, the fleet's adapters (configuration, the server's command line, the enqueue check), and the plan
grouping an adapter's prompts. Pure, or against a store file; the fleet runs them in test_e2e_lora.py."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from batchfleet.config import Config
from batchfleet.errors import ConfigError
from producer.enqueue import read_requests
from producer.fingerprint import canonical_request
from producer.inputs import Lines
from producer.parse import Reject, adapter_of, parse_line
from producer.plan import Dealer, PlanRow, adapter_group, plan_key
from producer.store import Store
from worker.flags import ServerCLI, build_argv, server_shape

HELP_0523 = Path(__file__).parents[1] / "sglang_sim" / "data" / "launch-help-0.5.23.txt"


def parse(line: dict, model: str = "base") -> tuple[str, str, dict]:
    return parse_line(orjson.dumps(line), {}, model)


# --- one stored form ---------------------------------------------------------------------------------
@pytest.mark.parametrize("line", [
    {"id": "a", "prompt": "hi", "model": "base:sql"},
    {"id": "a", "prompt": "hi", "lora_path": "sql"},
    {"id": "a", "prompt": "hi", "model": "base", "lora_path": "sql"},
    {"id": "a", "prompt": "hi", "model": "base: sql "},
    {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi", "model": "base:sql"}},
    {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi", "lora_path": "sql"}},
    {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi", "model": "base", "lora_path": "sql"}},
])
def test_both_ways_of_naming_an_adapter_are_stored_as_one_form_with_one_fingerprint(line: dict) -> None:
    _, url, body = parse(line)
    assert body == {"prompt": "hi", "model": "base:sql"}  # no lora_path: the form 0.5.23 takes first
    assert adapter_of(body) == "sql"
    want = canonical_request(url, {"prompt": "hi", "model": "base:sql"})
    assert canonical_request(url, body) == want  # the same fingerprint: dedup and resume agree


def test_the_models_suffix_wins_over_lora_path_as_in_sglang() -> None:
    # serving_base.py _resolve_lora_path: the adapter of `model` first, else lora_path
    assert parse({"id": "a", "prompt": "hi", "model": "base:sql", "lora_path": "chat"})[2]["model"] == "base:sql"
    batch = {"custom_id": "a", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": "x"}], "model": "m:one", "lora_path": "two"}}
    assert parse(batch)[2]["model"] == "m:one"


def test_no_adapter_stays_the_base_model() -> None:
    assert parse({"id": "a", "prompt": "hi"})[2]["model"] == "base"
    assert parse({"id": "a", "prompt": "hi", "model": "base:"})[2]["model"] == "base"  # "base:" is no adapter
    assert parse({"id": "a", "prompt": "hi", "lora_path": ""})[2]["model"] == "base"
    assert adapter_of({"model": "base"}) is None and adapter_of({"prompt": "x"}) is None
    # a line without a model takes the default one as its base
    assert parse({"id": "a", "prompt": "hi", "lora_path": "sql"}, model="org/M-8B")[2]["model"] == "org/M-8B:sql"


def test_a_lora_path_that_is_no_name_is_refused() -> None:
    with pytest.raises(Reject, match="lora_path must be a string"):
        parse({"id": "a", "prompt": "hi", "lora_path": ["sql"]})
    with pytest.raises(Reject, match="unknown sampling key 'lora_path'"):  # it is no sampling parameter
        parse({"id": "a", "prompt": "hi", "sampling_params": {"lora_path": "sql"}})


def test_an_adapter_the_fleet_does_not_load_is_refused_at_enqueue_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in [
        {"id": "1", "prompt": "hi", "lora_path": "sql"},
        {"id": "2", "prompt": "hi", "model": "base:nope"},
        {"id": "3", "prompt": "hi"},
    ]))
    with Lines(str(path)) as lines:
        got = [g for _, _, _, g in read_requests(lines, {}, "base", adapters=frozenset({"sql", "chat"}))]
    assert isinstance(got[0], tuple) and isinstance(got[2], tuple)
    assert isinstance(got[1], Reject)
    assert str(got[1]).startswith("unknown LoRA adapter 'nope': the fleet's servers load chat, sql")
    with Lines(str(path)) as lines:  # no adapters at all
        got = [g for _, _, _, g in read_requests(lines, {}, "base", adapters=frozenset())]
    assert "unknown LoRA adapter 'sql': the fleet's servers load none" in str(got[0])


# --- the fleet's adapters ------------------------------------------------------------------------------
def test_the_fleets_adapters_from_the_configuration_and_the_servers_own_flags() -> None:
    c = Config.from_env({"BATCHFLEET_LORA_PATHS": "sql=/a/sql, chat=/a/chat", "BATCHFLEET_MAX_LORAS_PER_BATCH": "4"})
    assert c.lora_paths == ("sql=/a/sql", "chat=/a/chat") and c.max_loras_per_batch == 4
    assert c.lora_adapters == {"sql": "/a/sql", "chat": "/a/chat"}
    # or the server's own flags, as SGLang reads their items
    c = Config.from_env({"BATCHFLEET_SERVER_ARGS": "--lora-paths more=/a/more /a/bare '{\"lora_name\": \"j\", "
                         "\"lora_path\": \"/a/j\"}' --tp-size 1"})
    assert c.lora_adapters == {"more": "/a/more", "/a/bare": "/a/bare", "j": "/a/j"}
    with pytest.raises(ConfigError, match="names an adapter twice: sql"):
        Config(lora_paths=("sql=/a", "sql=/b"))
    with pytest.raises(ConfigError, match="want NAME=PATH"):
        Config(lora_paths=("=/a",))
    with pytest.raises(ConfigError, match="max_loras_per_batch must be at least 1"):
        Config(max_loras_per_batch=0)
    with pytest.raises(ConfigError, match="given twice"):
        Config(lora_paths=("sql=/a",), server_args="--lora-paths chat=/b")


def test_the_worker_starts_its_server_with_the_adapters_in_0_5_23s_flags() -> None:
    cli = ServerCLI.from_help(HELP_0523.read_text())  # the real --help of SGLang 0.5.23
    config = Config(model_path="/models/m", lora_paths=("sql=/a/sql", "chat=/a/chat"), max_loras_per_batch=4)
    argv = build_argv(config, cli, port=30000)
    at = argv.index("--enable-lora")
    assert argv[at:at + 6] == ["--enable-lora", "--lora-paths", "sql=/a/sql", "chat=/a/chat",
                               "--max-loras-per-batch", "4"]
    assert server_shape(argv) == "tp1+lora4"  # another kind of server: the memory's key, the peer groups
    plain = build_argv(Config(model_path="/models/m"), cli, port=30000)
    assert "--enable-lora" not in plain and "--lora-paths" not in plain and server_shape(plain) == "tp1"
    assert server_shape(["--lora-paths", "a=/x"]) == "tp1+lora8"  # SGLang's default slots


# --- the plan groups by adapter --------------------------------------------------------------------------
def lines_on_adapters(n_adapters: int, per: int, seed: int = 5) -> list[dict]:
    rows = [{"id": f"a{a}-{i}", "prompt": f"question {i} for adapter {a}", "max_tokens": 32,
             **({"model": f"base:ad{a}"} if a else {})} for a in range(n_adapters) for i in range(per)]
    random.Random(seed).shuffle(rows)
    return rows


def test_the_plan_feeds_each_adapters_prompts_together_whatever_the_input_order(tmp_path: Path) -> None:
    store = Store.create_or_open(tmp_path / "s.sqlite", run="t")
    rows = lines_on_adapters(6, 40)
    with store.write():
        fid = store.file_id("in")
        batch = []
        for i, line in enumerate(rows, 1):
            cid, url, body = parse(line)
            canon, fp = canonical_request(url, body)
            batch.append((cid, 1, canon, fid, i, 32, fp, plan_key(canon, body)))
        store.insert_prompts(batch)
        store.plan.rebuild()
    with store.write():
        fed = store.next_to_feed(10_000)
    adapters = [adapter_of(orjson.loads(r.body)) for r in fed]
    runs = [a for i, a in enumerate(adapters) if i == 0 or adapters[i - 1] != a]
    # short prompts (no prefix key) of one cost: the model seeding the prefix key does not group them
    # (their keys are empty); without the adapter's group they keep the shuffled order
    assert sorted(runs, key=str) == sorted({None, *(f"ad{a}" for a in range(1, 6))}, key=str)
    assert runs[0] is None  # the base model's first
    assert all(r.group == adapter_group(plan_key(r.body, orjson.loads(r.body))) for r in fed)
    store.close()


def test_units_stay_within_one_adapter_and_go_to_the_queue_that_ran_it() -> None:
    def row(seq: int, adapter: str | None) -> PlanRow:
        body = {"max_tokens": 8, "model": f"m:{adapter}" if adapter else "m", "prompt": f"p{seq}"}
        canon = canonical_request("/v1/completions", body)[0]
        return PlanRow(seq, f"c{seq}", "/v1/completions", canon, "", seq, 8, adapter_group(plan_key(canon, body)))

    rows = [row(i, "x") for i in range(1, 6)] + [row(i, "y") for i in range(6, 9)] + [row(9, None), row(10, None)]
    dealer = Dealer(unit_max=4)
    units = dealer.units(rows)
    assert [[r.seq for r in u.rows] for u in units] == [[1, 2, 3, 4], [5], [6, 7, 8], [9], [10]]
    dealt = dealer.deal(units, {"q0": 100, "q1": 100, "q2": 100})
    assert [[r.seq for u in dealt[q] for r in u.rows] for q in ("q0", "q1", "q2")] == \
        [[1, 2, 3, 4, 5, 10], [6, 7, 8], [9]]  # x's units to one queue; the base's, unkeyed, in turn
    # the next pass: y's prompts go to the queue that ran y last
    assert dealer.deal(dealer.units([row(11, "y")]), {"q0": 100, "q1": 100, "q2": 100})["q1"]
