"""Abusive clients against a live ``moestream serve`` process on loopback.

Over 1,000 malformed or hostile requests (wrong types, huge numbers, deep JSON, invalid
UTF-8, 10 MB bodies, negative and enormous ``max_tokens``, unknown roles, garbage HTTP):
no 5xx, the server keeps answering, its memory stays bounded. Then 16 concurrent
streaming clients that disconnect at random: every completed stream is well formed, and
the process's open file descriptors and memory come back to where they started.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moestream.cli import main

from .helpers import write_tiny_synth_config

MAX_CONTEXT = 24  # every generation is short: the fuzz measures the server, not the model
MAX_PROMPT = 16
MB = 1_000_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_server(root, *flags: str):
    """``moestream serve`` on the tiny synth in ``root``, as a process of its own: (url, process)."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(root / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moestream", "serve", "--model", str(root / "tiny"), "--port", str(port),
         "--max-queue", "32", "--cache-budget-gb", "0.00005", "--prefetch-workers", "2", "--no-hotlist",
         "--no-learn-experts", *flags],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.2)
    return url, proc


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    # a context of 32,768 tokens, for a server whose byte bound lets 1 MB prompts through to the tokenizer
    cfg = write_tiny_synth_config(root / "config.json", max_position_embeddings=32768)
    assert main(["synth", "--config", str(cfg), "--out", str(root / "tiny")]) == 0
    return root


@pytest.fixture(scope="module")
def server(tiny_root):
    url, proc = start_server(tiny_root, "--max-context", str(MAX_CONTEXT), "--max-body-mb", "1",
                             "--max-prompt-tokens", str(MAX_PROMPT))
    yield url, proc
    stop_server(proc)


def idle(url: str) -> None:
    deadline = time.time() + 60
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        if not h["busy"] and not h["waiting"]:
            return
        assert time.time() < deadline, h
        time.sleep(0.05)


# ---- hostile requests ----------------------------------------------------------------

HOSTILE = [None, True, False, "", "x", "\u0000", "\ud800", -1, 0, 1, 2**31, 2**63, 2**64, -(2**63), 10**30,
           1e308, -1e308, float("nan"), float("inf"), 0.5, [], {}, [[[]]], [1, "a", None], {"a": {"b": [1]}},
           "A" * 5000, ["stop"] * 100, [{"role": "user"}]]
FIELDS = ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "stop", "frequency_penalty", "presence_penalty", "repetition_penalty", "n", "stream", "stream_options",
          "logprobs", "top_logprobs", "tools", "tool_choice", "chat_template_kwargs", "model", "prompt", "echo"]


def nested(depth: int, leaf: object = 1) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def hostile_requests(rng: random.Random):
    """(method, path, body bytes or None, headers, chunked) tuples; every kind at least once."""
    ok_msg = [{"role": "user", "content": "hi"}]
    chat, comp = "/v1/chat/completions", "/v1/completions"

    def dump(obj) -> bytes:
        return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")

    cases = []
    for field in FIELDS:  # every field with every hostile value, on both endpoints
        for value in HOSTILE:
            base = {"messages": ok_msg, "max_tokens": 1} if rng.random() < 0.5 else {"prompt": "hi", "max_tokens": 1}
            path = chat if "messages" in base else comp
            cases.append(("POST", path, dump({**base, field: value}), {}, False))
    for n in (-(10**30), -1, 0, MAX_CONTEXT, 2**31, 2**63, 10**100):  # negative and enormous max_tokens
        cases.append(("POST", chat, dump({"messages": ok_msg, "max_tokens": n}), {}, False))
        cases.append(("POST", comp, dump({"prompt": "a b", "max_tokens": n}), {}, False))
    for depth in (50, 500, 990, 5000, 200_000):  # deep JSON, whole body and inside fields
        cases.append(("POST", chat, b"[" * depth + b"]" * depth, {}, False))
        d = min(depth, 900)
        cases.append(("POST", chat, dump({"messages": ok_msg, "max_tokens": 1, "chat_template_kwargs":
                                          {"x": nested(d)}}), {}, False))
        cases.append(("POST", chat, dump({"messages": ok_msg, "max_tokens": 1, "tools": [nested(d, {})]}), {}, False))
        cases.append(("POST", chat, dump({"messages": [{"role": "user", "content": nested(d, "x")}]}), {}, False))
    for _ in range(30):  # invalid UTF-8
        junk = bytes(rng.randrange(128, 256) for _ in range(rng.randrange(1, 40)))
        cases.append(("POST", chat, b'{"messages": [{"role": "user", "content": "' + junk + b'"}]}', {}, False))
        cases.append(("POST", comp, b'{"prompt": "' + junk + b'", "max_tokens": 1}', {}, False))
        cases.append(("POST", chat, junk, {}, False))
    cases.append(("POST", chat, b"\xef\xbb\xbf" + dump({"messages": ok_msg, "max_tokens": 1}), {}, False))
    cases.append(("POST", chat, b'{"messages": [{"role": "user", "content": "\\udc80\\ud800"}], "max_tokens": 1}',
                  {}, False))
    for role in ("wizard", "", "USER", "function", None, 5, ["user"], "system\u0000", "\ud800"):  # unknown roles
        cases.append(("POST", chat, dump({"messages": [{"role": role, "content": "x"}], "max_tokens": 1}), {}, False))
    for content in (5, None, [], [{"type": "image_url", "image_url": "x"}], [{"type": "text"}], {"text": "x"}):
        cases.append(("POST", chat, dump({"messages": [{"role": "user", "content": content}], "max_tokens": 1}),
                      {}, False))
    for prompt in ([], [-1], [2**63], [10**30], [1, "a"], [[1]], [""], ["a", "b"], 5, None, [151936]):
        cases.append(("POST", comp, dump({"prompt": prompt, "max_tokens": 1}), {}, False))
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (10 * MB) + b'"}]}'
    for chunked in (False, False, True, True):  # 10 MB bodies, with and without Content-Length
        cases.append(("POST", chat, big, {}, chunked))
    cases.append(("POST", chat, b"x" * (10 * MB), {"Content-Type": "text/plain"}, False))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        cases.append(("POST", chat, dump({"messages": ok_msg, "max_tokens": 1}), {"Content-Type": ctype}, False))
    for method, path in (("GET", chat), ("PUT", chat), ("DELETE", comp), ("GET", "/v1/../etc/passwd"),
                         ("GET", "/v1/models/" + "x" * 5000), ("POST", "/health"), ("GET", "/%00"),
                         ("PATCH", "/v1/models"), ("POST", "/v1/embeddings")):
        cases.append((method, path, b"{}", {}, False))
    for _ in range(200):  # random structures from the hostile values
        body = {rng.choice(FIELDS): rng.choice(HOSTILE) for _ in range(rng.randrange(1, 6))}
        if rng.random() < 0.7:
            body.setdefault("messages", [{"role": rng.choice(["user", "system", "tool", "assistant", "x"]),
                                          "content": rng.choice(HOSTILE)}])
        cases.append(("POST", rng.choice([chat, comp]), dump(body), {}, False))
    return cases


RAW = [  # garbage that is not HTTP, or barely
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 64,  # a TLS ClientHello
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 200_000 + b"\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"\r\n\r\n\r\n",
    b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
]


def send(client: httpx.Client, url: str, case) -> int:
    method, path, body, headers, chunked = case
    headers = {"Content-Type": "application/json", **headers}
    content = body
    if chunked and body is not None:
        content = (body[i : i + 65536] for i in range(0, len(body), 65536))
    try:
        r = client.request(method, url + path, content=content, headers=headers)
    except httpx.TransportError as e:  # the server dropped the connection: not an answer
        raise AssertionError(f"{method} {path} {(body or b'')[:80]!r} ({len(body or b'')} bytes): {e!r}") from None
    assert r.status_code < 500, (method, path, (body or b"")[:300], r.status_code, r.text[:500])
    is_json = r.headers.get("content-type", "").startswith("application/json")
    if path.startswith("/v1/") and r.status_code >= 400 and is_json:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    return r.status_code


def test_a_thousand_hostile_requests_no_5xx_bounded_memory(server):
    url, proc = server
    cases = hostile_requests(random.Random(0))
    assert len(cases) + len(RAW) >= 1000, len(cases)
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for case in cases[:50]:  # warm up: first allocations of every code path
            code = send(client, url, case)
            statuses[code] = statuses.get(code, 0) + 1
        idle(url)
        rss0, fds0 = rss(proc.pid), fds(proc.pid)

        def worker(chunk):
            # a fresh connection per request: no race with the server closing an idle keep-alive one
            with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                return [send(c, url, case) for case in chunk]

        rest = cases[50:]
        with ThreadPoolExecutor(4) as pool:
            for codes in pool.map(worker, [rest[i::4] for i in range(4)]):
                for code in codes:
                    statuses[code] = statuses.get(code, 0) + 1
        for raw in RAW:
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
                try:
                    s.sendall(raw)
                    s.shutdown(socket.SHUT_WR)
                    reply = s.recv(64)
                except OSError:
                    reply = b""  # the server may drop a connection that is not HTTP
            assert not reply.startswith(b"HTTP/1.1 5"), (raw[:60], reply)
        assert all(code < 500 for code in statuses), statuses
        assert statuses.get(413, 0) >= 5 and statuses.get(400, 0) >= 500 and statuses.get(200, 0) >= 5, statuses
        idle(url)
        # still answering, and correctly
        r = client.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        grown = rss(proc.pid) - rss0
        assert grown < 64 * MB, f"RSS grew {grown / MB:.1f} MB over {len(cases)} hostile requests"
        assert fds(proc.pid) <= fds0 + 2
    assert proc.poll() is None


def stream_once(url: str, seed: int) -> tuple[str, list[str]]:
    """One streaming chat; disconnects after a random number of events half of the time."""
    rng = random.Random(seed)
    cut = rng.randrange(1, 6) if rng.random() < 0.5 else None
    body = {"messages": [{"role": "user", "content": f"count {seed}"}], "max_tokens": rng.randrange(4, 12),
            "temperature": 1, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if cut is not None and len(events) >= cut:
                    return "cut", events
    return "done", events


def test_sixteen_streaming_clients_with_random_disconnects(server):
    url, proc = server
    stream_once(url, 999)  # warm-up
    idle(url)
    rss0, fds0 = rss(proc.pid), fds(proc.pid)
    for round_ in range(2):
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda s: stream_once(url, s), range(round_ * 16, round_ * 16 + 16)))
        done = [ev for kind, ev in results if kind == "done"]
        assert 0 < len(done) < 16
        for ev in done:  # well formed: JSON chunks, one finish_reason, usage, then [DONE]
            assert ev[-1] == "[DONE]"
            chunks = [json.loads(e) for e in ev[:-1]]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
            assert len({c["id"] for c in chunks}) == 1
        idle(url)
    time.sleep(0.5)  # closed sockets leave the process
    assert fds(proc.pid) <= fds0 + 2, (fds0, fds(proc.pid))
    assert rss(proc.pid) - rss0 < 32 * MB
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_bounds_are_options(server, tmp_path, capsys):
    """--max-body-mb and --max-prompt-tokens (the fuzz server runs with 1 MB and 16 tokens)."""
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", content=b"{" + b" " * (MB + 10) + b"}",
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-body-mb" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", content=b"{" + b" " * (MB - 100) + b"}",
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400  # within the bound: parsed, and refused for what it is
    r = httpx.post(url + "/v1/completions", json={"prompt": list(range(MAX_PROMPT + 1)), "max_tokens": 1})
    assert r.status_code == 400
    assert f"at most {MAX_PROMPT} tokens (--max-prompt-tokens)" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": list(range(MAX_PROMPT)), "max_tokens": 1})
    assert r.status_code == 200
    for flag, value in (("--max-body-mb", "nan"), ("--max-prompt-tokens", "0")):
        assert main(["serve", "--model", str(tmp_path), flag, value]) == 2
        assert flag in capsys.readouterr().err


def test_api_key_is_compared_in_constant_time(monkeypatch):
    import hmac

    from moestream import serverguard

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(serverguard.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert serverguard.api_key_matches("Bearer s3cret", "s3cret")
    assert not serverguard.api_key_matches("Bearer s3cre", "s3cret")
    assert not serverguard.api_key_matches("Bearer \udcff", "s3cret")  # undecodable header bytes
    assert len(calls) == 3 and all(isinstance(a, bytes) for a, _ in calls)


def test_serve_binds_loopback_unless_told():
    import argparse

    from moestream.cli import _add_serve_args

    p = argparse.ArgumentParser()
    _add_serve_args(p)
    assert p.parse_args(["--model", "m"]).host == "127.0.0.1"


def words(rng: random.Random, nbytes: int) -> str:
    """Random lower-case words, ``nbytes`` long (ASCII): about 2.6 bytes per Qwen3 token."""
    out, n = [], 0
    while n < nbytes:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 9)))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:nbytes]


def post_one_token(client: httpx.Client, url: str, text: str, chat: bool) -> httpx.Response:
    """``text`` as a one-token chat message (``chat``) or completion prompt."""
    if chat:
        return client.post(url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": text}], "max_tokens": 1})
    return client.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 1})


def test_a_prompt_over_the_byte_bound_is_refused_before_tokenizing(server):
    """Twelve 0.95 MB prompts to a server of 16-token prompts: refused by length (no token of the Qwen3
    tokenizer is longer than 128 bytes), never tokenized, and the process keeps no memory of them."""
    url, proc = server
    rng = random.Random(5)
    idle(url)
    rss0 = rss(proc.pid)
    with httpx.Client(timeout=120) as c:
        for i in range(12):
            r = post_one_token(c, url, words(rng, 950_000), chat=i % 2 == 1)
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and "bytes" in err["message"], err
            assert f"at most {MAX_PROMPT} tokens (--max-prompt-tokens)" in err["message"]
    grown = rss(proc.pid) - rss0
    assert grown < 16 * MB, f"RSS grew {grown / MB:.1f} MB over twelve refused prompts"


def test_long_prompts_tokenized_and_refused_leave_no_memory_behind(tiny_root):
    """Six 1 MB prompts (under --max-body-mb 4) to a server of a 32,768-token context: under the byte
    bound, so tokenized (about 480,000 tokens each), and refused as over the context. Within seconds
    of the last answer the process is back within 32 MB of its size after the first of them (what a
    first long prompt allocates once is in that size): the memory the tokenizer freed goes back to
    the system (it kept 0.2 GB per 3 MB prompt in glibc's arenas)."""
    url, proc = start_server(tiny_root, "--max-context", "32768")
    try:
        rng = random.Random(6)
        with httpx.Client(timeout=300) as c:
            assert c.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 1}).status_code == 200
            idle(url)
            rss0 = None
            for i in range(6):
                r = post_one_token(c, url, words(rng, 1_000_000), chat=i % 2 == 1)
                assert r.status_code == 400, r.text[:300]
                err = r.json()["error"]
                assert err["code"] == "context_length_exceeded" and "(--max-context)" in err["message"], err
                assert "bytes" not in err["message"]  # counted, not refused by length
                if rss0 is None:  # the size after one long prompt: what stays must not grow with more of them
                    idle(url)
                    time.sleep(1)
                    rss0 = rss(proc.pid)
        idle(url)
        # without the tokenizer's trim the six prompts grew the process by 226 MB
        deadline = time.time() + 10
        while (grown := rss(proc.pid) - rss0) >= 32 * MB and time.time() < deadline:
            time.sleep(0.2)
        assert grown < 32 * MB, f"RSS is {grown / MB:.1f} MB above its size after the first of six refused 1 MB prompts"
    finally:
        stop_server(proc)
