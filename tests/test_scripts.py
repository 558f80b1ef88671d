"""Redis scripts as declared files (`batchfleet.scripts`): every `.lua` file declared and shipped, calls
checked by name, and every key a script touches either given in KEYS or derived as its declaration
says. The last is checked on a real Redis: the real ledger and producer code run every script as a
Redis ACL user that may touch exactly the keys of that call's KEYS and its declaration's derived
patterns, nothing else (Redis refuses any other key inside the script)."""

from __future__ import annotations

import asyncio
import re
import time
import tomllib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from batchfleet.acl import roles
from batchfleet.config import Config
from batchfleet.jobs import parse_job_data
from batchfleet.keys import Keys
from batchfleet.records import Prompt, Result
from batchfleet.scripts import Script, ScriptCallError, declared
from producer.api import enqueue
from producer.collect import collect_once
from producer.ends import cancel, purge
from producer.recover import audit, recover
from producer.scripts import EXPIRE
from worker.ledger import FINISH, Claim, Ledger

ROOT = Path(__file__).resolve().parents[1]
USER = "script-under-test"


def lua_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in ("batchfleet", "worker", "producer")
            for p in (ROOT / pkg).rglob("*.lua")}


def test_every_lua_file_is_declared_or_included_and_shipped_as_package_data() -> None:
    used = {"batchfleet/rqlayout.lua"} | {s.name for s in declared()}
    used |= {f"{s.package}/lua/{n}.lua" for s in declared() for n in s.include}
    assert lua_files() == used
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert all(list((ROOT / pkg).glob(g)) for pkg, globs in data.items() for g in globs)  # no entry for nothing
    shipped = {str(p.relative_to(ROOT)) for pkg, globs in data.items() for g in globs for p in (ROOT / pkg).glob(g)}
    assert lua_files() <= shipped


def test_no_script_file_spells_a_key_name() -> None:
    for name in lua_files():
        text = (ROOT / name).read_text()
        assert "rq:" not in text and "bf:" not in text, name


def test_a_call_whose_names_differ_from_the_declaration_is_refused_before_redis_sees_it(r: redis.Redis) -> None:
    r.set("x", 1)
    with pytest.raises(ScriptCallError, match=r"KEYS \['target'\] not declared; KEYS \['targets'\] missing"):
        EXPIRE.call(r, keys={"target": ["x"]}, args={"ttl": 5})
    with pytest.raises(ScriptCallError, match=r"ARGV \['ttl'\] missing"):
        EXPIRE.call(r, keys={"targets": ["x"]}, args={})
    with pytest.raises(ScriptCallError, match=r"KEYS registries holds 3 entries, not groups of 2 \(started, failed\)"):
        FINISH.call(r, keys={"leases": "l", "results": "s", "done": "d", "stats": "t", "strikes": "k", "jobs": [],
                             "registries": ["a", "b", "c"]},
                    args={"session": "x", "failure_ttl": 1, "origins": [], "outcomes": []})
    assert r.ttl("x") == -1
    assert EXPIRE.call(r, keys={"targets": ["x"]}, args={"ttl": 5}) == 1 and r.ttl("x") > 0


def test_each_role_may_write_every_key_its_scripts_derive() -> None:
    acl = roles()
    for script in declared():
        role = acl["worker" if script.package == "worker" else "producer"]
        assert set(script.derived_patterns) <= set(role.write), script


# --- every key a script touches, checked by Redis --------------------------------------------------------------
def _glob_literal(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", raw)


class KeyCheck:
    """Runs each script call as the ACL user USER, allowed the call's KEYS and (unless `derive` is off)
    the patterns its declaration derives; every other command of the code under test runs with all
    rights. Counts the calls per script."""

    def __init__(self, url: str, *, derive: bool = True) -> None:
        self.url = url
        self.derive = derive
        self.admin = redis.Redis.from_url(url)
        self.by_sha: dict[str, Script] = {s.sha: s for s in declared()}
        self.calls: Counter[str] = Counter()

    def allow(self, sha: str, numkeys: int, keys_and_args: Sequence[object]) -> None:
        script = self.by_sha[sha]
        self.calls[script.name] += 1
        patterns = [b"~" + _glob_literal(k) for k in keys_and_args[:numkeys]]  # type: ignore[arg-type]
        if self.derive:
            patterns += [b"~" + p.encode() for p in script.derived_patterns]
        self.admin.execute_command("ACL", "SETUSER", USER, "reset", "on", "nopass", "+@all", *patterns)

    def client(self) -> redis.Redis:
        c = _Checked.from_url(self.url)
        c.check, c.restricted = self, redis.Redis.from_url(self.url, username=USER, password="-")
        return c

    def async_client(self) -> aioredis.Redis:
        c = _CheckedAsync.from_url(self.url)
        c.check, c.restricted = self, aioredis.Redis.from_url(self.url, username=USER, password="-")
        return c

    def close(self) -> None:
        self.admin.execute_command("ACL", "DELUSER", USER)


class _Checked(redis.Redis):
    check: KeyCheck
    restricted: redis.Redis

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: object) -> object:  # type: ignore[override]
        self.check.allow(sha, numkeys, keys_and_args)
        return self.restricted.evalsha(sha, numkeys, *keys_and_args)  # type: ignore[arg-type]


class _CheckedAsync(aioredis.Redis):
    check: KeyCheck
    restricted: aioredis.Redis

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: object) -> object:  # type: ignore[override]
        self.check.allow(sha, numkeys, keys_and_args)
        return await self.restricted.evalsha(sha, numkeys, *keys_and_args)  # type: ignore[arg-type]


def _result(claim: Claim, *, ok: bool = True) -> Result:
    _, args, _ = parse_job_data(claim.data)
    p = Prompt.from_dict(args[0])
    if ok:
        return Result(cid=p.cid, jid=claim.jid, seq=p.seq, status_code=200, worker="a",
                      body={"choices": [{"text": "ok"}], "usage": {"completion_tokens": 3}})
    return Result(cid=p.cid, jid=claim.jid, seq=p.seq, status_code=400, worker="a",
                  error={"code": "invalid_prompt", "message": "too long"})


async def _play_workers(check: KeyCheck, k: Keys) -> None:
    """Every ledger script, with the branches that touch other keys: finishes of each kind, a hand-back,
    a death that quarantines, solo and suspect claims, a drop, a refeed, and a lapsed lease recovered."""
    admin, queues = check.admin, ["gpu0", "gpu1"]
    client = check.async_client()
    a = Ledger(client, k, worker="a", lease_ttl_s=600)
    c = await a.claim(10, queues)  # 8 from gpu0, then 2 from gpu1: c[1], c[6], c[7], c[9] stay in flight
    assert [x.origin for x in c] == ["gpu0"] * 8 + ["gpu1"] * 2
    a.finish(c[0], _result(c[0]))
    a.finish(c[8], _result(c[8], ok=False), exc_string="invalid_prompt: too long")  # two origins in one call
    a.refuse(c[2], "not this run's")
    await a.flush()
    assert [admin.zscore(Keys.failed(q), x.jid) is not None for q, x in (("gpu1", c[8]), ("gpu0", c[2]))] == [True] * 2
    assert admin.zcard(Keys.started("gpu0")) == 6 and admin.zcard(Keys.started("gpu1")) == 1
    assert await a.renew() == []
    assert await a.hand_back([c[3]]) == 1
    admin.hset(k.strikes, c[4].jid, 2)  # its third death, alone: quarantined; c[5] was waiting outside
    death = await a.after_server_death([(c[4], _result(c[4], ok=False))], [c[5]], exc_string="server_crash: died")
    assert death.quarantined == [c[4].jid] and death.handed_back == 1

    for queue, line in (("gpu0", k.isolate), ("gpu1", k.suspects)):
        jid = admin.rpop(Keys.queue(queue))
        admin.rpush(line, jid)
    (solo,) = await a.claim(2, queues, suspects=1, take_solo=True)
    suspect, normal = await a.claim(2, queues, suspects=1, take_solo=True)
    assert (solo.kind, suspect.kind, normal.kind) == ("solo", "suspect", "normal")
    assert await a.drop([solo]) == 1
    assert await a.refeed(suspect, "p-refed") is True

    b = Ledger(client, k, worker="b", lease_ttl_s=0.2)
    (lapsing,) = await b.claim(1, queues)
    deadline = time.monotonic() + 30
    recovered: list[str] = []
    while not recovered and time.monotonic() < deadline:
        recovered = await a.recover_lapsed()
        await asyncio.sleep(0.05)
    assert recovered == [lapsing.jid]
    await client.aclose()


def test_every_script_touches_only_the_keys_it_is_given_or_declares_it_derives(redis_url: str, tmp_path: Path) -> None:
    check = KeyCheck(redis_url)
    try:
        r = check.client()
        k = Keys("acl")
        config = Config(run="acl", redis_url=redis_url, state_dir=tmp_path / "state", queues=("gpu0", "gpu1"))
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_bytes(b"".join(orjson.dumps({"id": f"p{i}", "prompt": f"text {i}"}) + b"\n" for i in range(16)))
        store = enqueue(config, r, prompts, queues=("gpu0", "gpu1")).store
        try:
            asyncio.run(_play_workers(check, k))
            got = collect_once(r, store, k)  # trims the collected failures
            assert (got.succeeded, got.failed) == (1, 2)
            found = audit(r, store, k)
            assert found.counts["failed_foreign"] == 1  # the refused job: failed, no result
            assert recover(r, store, k, found=found).foreign == 1
            cancel(r, store, k, wait_s=0, ttl_s=60)  # removes jobs in each state; the run's keys expire
            assert purge(r, k, force=True).jobs > 0  # the failed jobs kept for `rq requeue`
        finally:
            store.close()
        assert sorted(check.calls) == sorted(s.name for s in declared())
    finally:
        check.close()


def test_the_key_check_refuses_a_key_the_script_was_not_allowed(redis_url: str, r: redis.Redis) -> None:
    """The check above is no formality: allowed only its KEYS, a claim that finds a job (it derives the
    job's hash and started registry) is refused by Redis."""
    r.hset(Keys.job("j1"), mapping={"data": "[]", "origin": "gpu0", "status": "queued"})
    r.rpush(Keys.queue("gpu0"), "j1")
    check = KeyCheck(redis_url, derive=False)

    async def go() -> None:
        client = check.async_client()
        try:
            await Ledger(client, Keys("t"), worker="w", lease_ttl_s=60).claim(1, ["gpu0"])
        finally:
            await client.aclose()

    try:
        with pytest.raises(redis.ResponseError, match="can't access"):
            asyncio.run(go())
    finally:
        check.close()
