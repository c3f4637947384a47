"""``moestream serve`` with several requests at once (--max-batch): through the real server on loopback with the
``openai`` client and httpx streams, each concurrent answer's tokens and log-probabilities are exactly those of the
same request alone on a fresh server; a conversation's second turn reuses the first's keys and values (the prefix
cache) and answers as a fresh server does; a disconnect or a stop string in one stream leaves the others as they
were."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from moestream.engine import load
from moestream.server import ServerOptions, create_app

from .helpers import cli_synth_tiny
from .test_server import Server

PROMPTS = ["Tell me about streaming experts.", "hi", "Name three rivers and say why they matter to people.",
           "The cache", "1 2 3 4", "What is a mixture of experts?", "ok", "Write a haiku about disks and memory."]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cli_synth_tiny(tmp_path_factory.mktemp("serve-batch"))


@pytest.fixture(scope="module")
def engines(ckpt):
    """Batched engines (a budget of a few experts with the prefix cache, and every expert resident), and the
    one that answers alone (no prefix cache)."""
    got = {"streamed": load(ckpt, cache_budget_gb=0.00005, workers=2, max_batch=8, prefix_cache_gb=0.01),
           "all": load(ckpt, cache_budget_gb="all", workers=2, max_batch=8),
           "solo": load(ckpt, cache_budget_gb=0.00005, workers=2)}
    yield got
    for e in got.values():
        e.close()


def _request(i: int) -> tuple[str, dict]:
    """Request i: chat or completions, greedy or seeded sampling, its own length and log-probabilities."""
    body = {"model": "tiny", "max_tokens": [12, 20, 7, 16, 9, 24, 5, 14][i], "logprobs": True}
    if i % 3 == 1:
        body.update(temperature=1.0, seed=100 + i)
    elif i % 3 == 2:
        body.update(temperature=0.8, top_p=0.9, seed=7)
    else:
        body.update(temperature=0)
    if i % 2:
        body.update(prompt=PROMPTS[i], logprobs=2)
        return "/v1/completions", body
    body.update(messages=[{"role": "user", "content": PROMPTS[i]}], top_logprobs=2)
    return "/v1/chat/completions", body


def _answer(url: str, path: str, body: dict) -> dict:
    """What a request's answer says (text, tokens and log-probabilities, finish reason, usage), streamed or not."""
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return {"text": c.get("text", (c.get("message") or {}).get("content")), "logprobs": c["logprobs"],
                "finish": c["finish_reason"], "completion_tokens": r.json()["usage"]["completion_tokens"]}
    events = _events(url, path, body)
    text, lps = "", []
    for e in events:
        for c in e.get("choices", []):
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            lps.append(c.get("logprobs"))
    return {"text": text, "logprobs": lps, "finish": [c["finish_reason"] for e in events for c in e["choices"]][-1]}


def _events(url: str, path: str, body: dict, leave_after: int | None = None) -> list[dict]:
    out = []
    with httpx.Client(timeout=120) as h, h.stream("POST", url + path, json=body) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            out.append(json.loads(line[6:]))
            if leave_after is not None and len(out) >= leave_after:
                break  # the client leaves: the connection closes with the with-block
    return out


def _together(calls) -> list:
    """Run the calls at once, on threads released together; their results in order."""
    results, barrier = [None] * len(calls), threading.Barrier(len(calls))

    def go(k):
        barrier.wait()
        results[k] = calls[k]()

    threads = [threading.Thread(target=go, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m[1])


def _solo_answers(engines, calls: list[tuple[str, dict]]) -> list[dict]:
    srv = Server(create_app(engines["solo"], ServerOptions("tiny", max_context=512, max_batch=1)))
    try:
        return [_answer(srv.url, p, b) for p, b in calls]
    finally:
        srv.stop()


@pytest.mark.parametrize("n, which", [(2, "streamed"), (8, "streamed"), (5, "all")])
def test_concurrent_requests_equal_their_solo_runs(engines, n, which):
    """n requests at once (chat and completions, greedy and seeded, streamed and not, other lengths and
    log-probabilities), at a budget below the model's experts and with every expert resident: each gives exactly
    the text, tokens and log-probabilities of the same request alone on a fresh server."""
    calls = []
    for i in range(n):
        path, body = _request(i)
        calls.append((path, {**body, "stream": i % 4 == 3}))
    want = _solo_answers(engines, calls)
    srv = Server(create_app(engines[which], ServerOptions("tiny", max_context=512, max_batch=8)))
    try:
        # on a loaded machine one request can finish before another arrives: up to three rounds, each exact,
        # until one of them has batched
        for _ in range(3):
            one0, all0 = (_metric(srv.url, 'moestream_batch_size_bucket{le="1.0"}'),
                          _metric(srv.url, "moestream_batch_size_count"))
            got = _together([lambda p=p, b=b: _answer(srv.url, p, b) for p, b in calls])
            for k in range(n):
                assert got[k] == want[k], f"request {k}: {calls[k]}"
            steps = _metric(srv.url, "moestream_batch_size_count") - all0
            alone = _metric(srv.url, 'moestream_batch_size_bucket{le="1.0"}') - one0
            if steps > alone:  # some steps carried more than one sequence: they were batched
                break
        assert steps > alone, "no step carried more than one sequence in three rounds"
    finally:
        srv.stop()


def test_turn_two_reuses_turn_one_and_equals_a_fresh_server(engines):
    history = [{"role": "system", "content": "You are terse. " * 8},
               {"role": "user", "content": "Tell me about streaming experts and their caches."}]
    srv = Server(create_app(engines["streamed"], ServerOptions("tiny", max_context=512, max_batch=8)))
    fresh = Server(create_app(engines["solo"], ServerOptions("tiny", max_context=512)))
    try:
        c, f = srv.client(), fresh.client()
        one = c.chat.completions.create(model="tiny", messages=history, max_tokens=10, temperature=0)
        turn2 = history + [{"role": "assistant", "content": one.choices[0].message.content},
                           {"role": "user", "content": "And the budget?"}]
        hits = _metric(srv.url, "moestream_prefix_cache_hit_tokens_total")
        kw = dict(model="tiny", messages=turn2, max_tokens=12, temperature=1.0, seed=3, logprobs=True, top_logprobs=3)
        two = c.chat.completions.create(**kw)
        cached = two.usage.prompt_tokens_details.cached_tokens
        assert cached >= one.usage.prompt_tokens // 16 * 16 > 0
        assert _metric(srv.url, "moestream_prefix_cache_hit_tokens_total") - hits == cached
        ref = f.chat.completions.create(**kw)
        assert ref.usage.prompt_tokens_details.cached_tokens == 0
        assert two.choices[0].message.content == ref.choices[0].message.content
        assert two.choices[0].logprobs == ref.choices[0].logprobs
        assert two.usage.completion_tokens == ref.usage.completion_tokens
        # streamed, the usage chunk says the same
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
            ref.choices[0].message.content
    finally:
        srv.stop()
        fresh.stop()


def test_a_disconnect_or_a_stop_string_in_one_of_four_streams_leaves_the_others(engines):
    base = [_request(i) for i in (0, 1, 2, 4)]
    calls = [(p, {**b, "stream": True, "max_tokens": 40, "ignore_eos": True}) for p, b in base]
    plain = _solo_answers(engines, calls)
    text = plain[1]["text"]
    k = next(k for k in range(len(text) // 3, len(text) - 3) if not any(c.isspace() for c in text[k : k + 3]))
    stop = text[k : k + 3]
    assert text.index(stop) > 0, text
    calls[1][1]["stop"] = [stop]
    want = _solo_answers(engines, calls)
    assert want[1]["text"] == text[: text.index(stop)] and want[1]["finish"] == "stop"
    srv = Server(create_app(engines["streamed"], ServerOptions("tiny", max_context=512, max_batch=8)))
    try:
        left = []

        def leaves():
            left.append(_events(srv.url, calls[0][0], calls[0][1], leave_after=3))

        got = _together([leaves] + [lambda p=p, b=b: _answer(srv.url, p, b) for p, b in calls[1:]])
        assert len(left[0]) == 3
        deadline = time.time() + 20
        while httpx.get(srv.url + "/health").json()["running"]:
            assert time.time() < deadline, "the sequence whose client left still runs"
            time.sleep(0.05)
    finally:
        srv.stop()
    for k in (1, 2, 3):
        assert got[k] == want[k], f"stream {k}"


def test_request_fields_min_tokens_and_ignore_eos(engines):
    srv = Server(create_app(engines["streamed"], ServerOptions("tiny", max_context=512, max_batch=2, max_queue=0)))
    try:
        post = lambda body: httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", **body}, timeout=60)  # noqa: E731
        for body, param in (({"max_tokens": 3, "min_tokens": 4}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                            ({"ignore_eos": "yes"}, "ignore_eos"), ({"min_tokens": 1.5}, "min_tokens")):
            r = post(body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, r.json()
        r = post({"max_tokens": 30, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = post({"max_tokens": 9, "min_tokens": 9, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 9
    finally:
        srv.stop()


def test_full_batch_and_queue_answer_429_and_metrics(engines):
    srv = Server(create_app(engines["streamed"], ServerOptions("tiny", max_context=4096, max_batch=2, max_queue=1)))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=60) as h:
            streams = [h.stream("POST", srv.url + "/v1/chat/completions", json=body) for _ in range(3)]
            opened = [s.__enter__() for s in streams]
            try:
                lines = [o.iter_lines() for o in opened[:2]]
                for it in lines:
                    assert next(it).startswith("data: ")
                deadline = time.time() + 20
                while httpx.get(srv.url + "/health").json()["waiting"] != 1:
                    assert time.time() < deadline
                    time.sleep(0.05)
                with pytest.raises(openai.RateLimitError) as e:
                    srv.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=1)
                assert e.value.body["code"] == "queue_full" and "--max-batch 2" in e.value.body["message"]
                assert _metric(srv.url, "moestream_running_sequences") == 2
                assert _metric(srv.url, "moestream_waiting_sequences") == 1
                assert _metric(srv.url, "moestream_queue_depth") == 3
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        deadline = time.time() + 20
        while httpx.get(srv.url + "/health").json()["busy"]:
            assert time.time() < deadline, "the streams whose clients left still run"
            time.sleep(0.05)
        r = srv.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=2)
        assert r.usage.completion_tokens >= 1
    finally:
        srv.stop()


def test_rss_within_the_budget_plan_after_200_concurrent_requests(ckpt, tmp_path):
    """200 requests at once of mixed prompt and answer sizes, streamed and not, against a ``moestream serve``
    process with --max-batch 8: every one answered, and its RSS afterwards within the warmed-up process's plus the
    KV caches and prefix cache the budget plan counts (and 32 MB of allocator slack)."""
    import asyncio
    import random

    from .test_reliability_server import MB, idle, rss, start_server, stop_server

    (tmp_path / "tiny").symlink_to(ckpt)
    url, proc = start_server(tmp_path, "--max-batch", "8", "--max-queue", "200", "--max-context", "64",
                             "--prefix-cache-gb", "0.002")
    rng = random.Random(0)
    words = "the cache streams experts from disk while a batch decodes".split()

    def body(k: int) -> dict:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 30)))
        return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randrange(1, 16),
                "temperature": rng.choice([0, 1]), "seed": k, "stream": k % 2 == 0}

    async def one(client, b) -> int:
        if not b["stream"]:
            return (await client.post(url + "/v1/chat/completions", json=b)).status_code
        async with client.stream("POST", url + "/v1/chat/completions", json=b) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return r.status_code if lines[-1] == "data: [DONE]" else 599

    async def many(n: int) -> list[int]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, body(k)) for k in range(n)))

    try:
        assert set(asyncio.run(many(16))) == {200}  # warm-up: every code path's first allocations
        idle(url)
        rss0 = rss(proc.pid)
        codes = asyncio.run(many(200))
        assert codes.count(200) == 200, sorted(set(codes))
        idle(url)
        time.sleep(0.5)  # the scheduler gives freed memory back once idle (malloc_trim), just after the last step
        per_token = 2 * 2 * 2 * 2 * 8 * 2  # layers x (k, v) x kv heads x head dim x bf16
        plan = 8 * 2 * 64 * per_token + int(0.002e9)
        assert rss(proc.pid) - rss0 < plan + 32 * MB, (rss(proc.pid) - rss0) / MB
        text = httpx.get(url + "/metrics").text
        sizes = re.search(r'^moestream_batch_size_bucket\{le="1.0"\} (\S+)$', text, re.M)
        total = re.search(r"^moestream_batch_size_count (\S+)$", text, re.M)
        assert float(total[1]) > float(sizes[1])  # they ran batched
    finally:
        stop_server(proc)
