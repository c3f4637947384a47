"""``moestream serve`` on a real loopback port, driven by the official ``openai`` client."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from moestream.cli import _add_generate_args, main, run_generate
from moestream.engine import load
from moestream.server import ServerOptions, create_app
from moestream.tokenizer import chat_ids

from .helpers import Wrapped, write_tiny_synth_config

PROMPT = "Tell me about streaming experts."


class Server:
    """A uvicorn server for one app on a free loopback port, in a thread."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    cfg = write_tiny_synth_config(root / "config.json")
    out = root / "tiny"
    assert main(["synth", "--config", str(cfg), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = load(ckpt, cache_budget_gb=0.00005, workers=2)  # a few experts: every token streams
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(create_app(engine, ServerOptions("tiny", max_context=512, max_queue=4)))
    yield srv
    srv.stop()


def _cli_text(ckpt, *flags) -> str:
    """What ``moestream generate`` prints for these flags."""
    parser = argparse.ArgumentParser()
    _add_generate_args(parser)
    args = parser.parse_args(["--model", str(ckpt), "--cache-budget-gb", "0.00005", "--quiet", *flags])
    out, err = io.StringIO(), io.StringIO()
    run_generate(args, out=out, err=err)
    return out.getvalue()[:-1]  # the CLI ends with a newline


def test_models_health_and_page(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "tiny"
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text


def test_chat_equals_cli_generate(server, ckpt, engine):
    want = _cli_text(ckpt, "--prompt", PROMPT, "--max-tokens", "12", "--temp", "1", "--seed", "7")
    c = server.client()
    msgs = [{"role": "user", "content": PROMPT}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=1, seed=7)
    assert r.choices[0].message.content == want
    prompt_len = len(chat_ids(engine.tokenizer, msgs))
    assert r.usage.prompt_tokens == prompt_len
    assert r.usage.total_tokens == prompt_len + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("length", "stop")
    # streamed: the same text, a role first, usage last
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=1, seed=7,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason


def test_completions_stop_strings_and_usage(server, engine):
    c = server.client()
    r = c.completions.create(model="tiny", prompt="The cache", max_tokens=24, temperature=0)
    text = r.choices[0].text
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode("The cache", add_special_tokens=False))
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = c.completions.create(model="tiny", prompt="The cache", max_tokens=24, temperature=0,
                               stop=["never-appears-xyz", stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model="tiny", prompt="The cache", max_tokens=24, temperature=0,
                                         stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text[: text.index(stop)]


def test_logprobs_are_the_models(server, engine):
    c = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                  top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
    ids = torch.tensor(chat_ids(engine.tokenizer, msgs))
    with torch.inference_mode():
        logits = engine.model(ids, 0, engine.model.new_kv_cache())[0].float()
    first = torch.log_softmax(logits, -1)
    assert content[0].logprob == pytest.approx(float(first.max()), abs=1e-4)


class Scripted(Wrapped):
    """The real model, with the next token of ``script`` made certain at each call (to test text handling)."""

    def __init__(self, model, tokenizer, script: str):
        super().__init__(model)
        self.ids = tokenizer.encode(script, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.calls = 0

    def forward(self, ids, start, kv, all_logits=False):
        logits = self.inner(ids, start, kv, all_logits)
        logits[..., self.ids[min(self.calls, len(self.ids) - 1)]] += 1e4
        self.calls += 1
        return logits


def test_reasoning_content_is_split(server, engine, monkeypatch):
    script = "<think>\nweigh it\n</think>\n\nYes."
    monkeypatch.setattr(engine, "model", Scripted(engine.model, engine.tokenizer, script))
    c = server.client()
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ok?"}], max_tokens=32,
                                  temperature=0)
    msg = r.choices[0].message
    assert msg.content == "Yes."
    assert msg.model_extra["reasoning_content"] == "weigh it"
    assert r.choices[0].finish_reason == "stop"


def test_no_thinking_template_kwarg(server, engine):
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    plain = server.client().chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    off = server.client().chat.completions.create(
        model="tiny", messages=msgs, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == len(chat_ids(tok, msgs, None, {"enable_thinking": False}))
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens  # the empty <think></think> block


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(server, engine, monkeypatch, stream):
    tok = engine.tokenizer
    real = engine.model
    monkeypatch.setattr(engine, "model", Scripted(real, tok, CALL))
    c = server.client()
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        chunks = list(c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=64,
                                                temperature=0, stream=True))
        calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=64, temperature=0)
        choice = r.choices[0]
        calls, finish, content = choice.message.tool_calls, choice.finish_reason, choice.message.content
    assert finish == "tool_calls"
    assert not content
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    # the round trip: the call and its result go back through the chat template
    monkeypatch.setattr(engine, "model", Scripted(real, tok, "It is 18 C in Paris."))
    follow = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C"},
    ]
    r2 = c.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=32, temperature=0)
    assert r2.choices[0].message.content == "It is 18 C in Paris."
    assert r2.choices[0].finish_reason == "stop"
    rendered = [dict(m) for m in follow]
    rendered[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    text = tok.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n18 C\n</tool_response>" in text and '"city": "Paris"' in text
    assert r2.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_queue_full_429_and_disconnect_cancels(engine):
    srv = Server(create_app(engine, ServerOptions("tiny", max_context=4096, max_queue=0)))
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000,
                "temperature": 1, "seed": 1, "stream": True}
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", srv.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                got = 0
                for line in lines:
                    got += line.startswith("data: ")
                    if got >= 3:
                        break
                with pytest.raises(openai.RateLimitError) as e:
                    srv.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=1)
                assert e.value.response.headers["retry-after"] == "1"
                assert e.value.body["code"] == "queue_full"
            # the stream is closed: the generation stops at the next token and the model is free again
            deadline = time.time() + 10
            while h.get(srv.url + "/health").json()["busy"]:
                assert time.time() < deadline, "the generation did not stop after the client left"
                time.sleep(0.02)
        made = httpx.get(srv.url + "/stats").json()["tokens_generated"]
        time.sleep(0.3)
        assert httpx.get(srv.url + "/stats").json()["tokens_generated"] == made < 3000
        r = srv.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=2)
        assert r.usage.completion_tokens >= 1
    finally:
        srv.stop()


def _post(url: str, body, headers=None) -> httpx.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url + "/v1/chat/completions", content=data,
                      headers={"Content-Type": "application/json", **(headers or {})}, timeout=30)


@pytest.mark.parametrize("body, param, status", [
    ("{not json", None, 400),
    ({"messages": []}, "messages", 400),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature", 400),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", 400),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n", 400),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", 400),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "messages", 400),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, "max_tokens", 400),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop", 400),
    ({"messages": "hello"}, "messages", 400),
    ({"messages": [{"role": "user"}]}, "messages.0", 400),  # no content: not an empty prompt run to the context
    ({"messages": [{"role": "user", "content": None}]}, "messages.0", 400),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}, "messages.1", 400),
])
def test_bad_requests_get_openai_errors(server, body, param, status):
    r = _post(server.url, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert (err["param"] or "").startswith(param), err


def test_unknown_fields_are_ignored_and_404_has_openai_shape(server):
    r = _post(server.url, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "some_new_field": [1]})
    assert r.status_code == 200
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_api_key(engine):
    srv = Server(create_app(engine, ServerOptions("tiny", max_context=512, api_key="s3cret")))
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").models.list()
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert [m.id for m in srv.client("s3cret").models.list().data] == ["tiny"]
    finally:
        srv.stop()


def test_metrics(server):
    server.client().completions.create(model="tiny", prompt="a b c", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    for name in ("moestream_generated_tokens_total", "moestream_requests_total", "moestream_queue_depth",
                 "moestream_cache_hit_rate", "moestream_disk_read_bytes_total", "moestream_decode_tokens_per_second"):
        assert name in text, name
    read = [ln for ln in text.splitlines() if ln.startswith("moestream_disk_read_bytes_total")][0]
    assert float(read.split()[-1]) > 0  # a tiny budget: every token reads experts
    assert 'endpoint="/v1/completions",status="200"' in text


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(not _chromium() and not os.environ.get("MOESTREAM_REQUIRE_BROWSER"),
                    reason="no chromium here (CI installs it; set MOESTREAM_REQUIRE_BROWSER=1 to insist)")
def test_chat_page_in_headless_chromium(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.fill("#max", "8")
            page.fill("#input", "Hello from the browser")
            page.press("#input", "Enter")
            page.wait_for_selector('.assistant[data-done="1"]', timeout=60_000)
            assert page.inner_text(".user") == "Hello from the browser"
            assert page.inner_text(".assistant").strip()
            page.wait_for_function("document.getElementById('tokens').textContent !== '-'", timeout=10_000)
            assert page.inner_text("#hit").endswith("%")
        finally:
            browser.close()


# ---- issue 19: disconnects, templates, errors, metrics, the rough edges -------------------

def _idle_within(url: str, seconds: float) -> None:
    deadline = time.time() + seconds
    while True:
        h = httpx.get(url + "/health").json()
        if not h["busy"] and not h["waiting"]:
            return
        assert time.time() < deadline, f"still working {seconds} s later: {h}"
        time.sleep(0.05)


class Endless(Scripted):
    """The real model with the end-of-turn token masked: every generation runs to its max_tokens."""

    def forward(self, ids, start, kv, all_logits=False):
        logits = self.inner(ids, start, kv, all_logits)
        logits[..., self.ids[-1]] = float("-inf")
        return logits


def _raw_request(port: int, path: str, body: dict) -> socket.socket:
    """An HTTP request sent on a socket of its own, so that the test decides when its client leaves."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _wait_for(what: str, seconds: float, check) -> dict:
    deadline = time.time() + seconds
    while True:
        got = check()
        if got:
            return got
        assert time.time() < deadline, what
        time.sleep(0.1)  # not faster: each poll takes the GIL from the generation


def test_a_non_streamed_client_that_leaves_stops_its_generation(engine, monkeypatch):
    """Queued or running, a request whose client is gone (closed its connection, as the openai client does
    on a timeout) generates nothing more, and the queue moves on."""
    monkeypatch.setattr(engine, "model", Endless(engine.model, engine.tokenizer, ""))
    srv = Server(create_app(engine, ServerOptions("tiny", max_context=4096, max_queue=4)))
    health = lambda: httpx.get(srv.url + "/health", timeout=30).json()  # noqa: E731
    made = lambda: httpx.get(srv.url + "/stats", timeout=30).json()["tokens_generated"]  # noqa: E731
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000,
                "temperature": 1, "seed": 1}
        with httpx.Client(timeout=60) as h, h.stream("POST", srv.url + "/v1/chat/completions",
                                                     json={**body, "stream": True}) as held:
            lines = held.iter_lines()  # kept: a dropped iterator would close the stream
            assert next(lines).startswith("data: ")  # it holds the model
            queued = _raw_request(srv.port, "/v1/chat/completions", body)
            _wait_for("the second request did not reach the queue", 60, lambda: health()["waiting"] == 1)
            queued.close()  # its client leaves while it waits
            _wait_for("a request whose client left still waits in the queue", 10,
                      lambda: health()["waiting"] == 0)
            assert health()["busy"]  # the stream still runs: the queue dropped the request, not the model
        _idle_within(srv.url, 30)
        before = made()
        running = _raw_request(srv.port, "/v1/chat/completions", body)
        _wait_for("the request did not start generating", 60, lambda: made() > before + 2)
        running.close()  # its client leaves mid-generation
        _idle_within(srv.url, 30)
        n = made() - before
        time.sleep(0.3)
        assert made() - before == n < 3000
        r = srv.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=2)
        assert r.usage.completion_tokens == 2
    finally:
        srv.stop()


LOOP = "{% for i in range(1700) %}{% for j in range(1700) %}ab {% endfor %}{% endfor %}hi"


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "documents", "add_generation_prompt", "messages",
                                 "tools", "continue_final_message", "raise_exception", "eos_token"])
def test_a_request_cannot_override_the_chat_template(server, key):
    r = _post(server.url, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                           "chat_template_kwargs": {"enable_thinking": False, key: "{{ 'PWNED' }}"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"chat_template_kwargs.{key}" and repr(key) in err["message"], err
    assert err["code"] == "invalid_value"


def test_a_template_sent_by_a_client_is_refused_and_kwargs_are_data(server, engine):
    c = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                  extra_body={"chat_template_kwargs": {"chat_template": LOOP}})
    assert "chat_template" in e.value.body["message"]
    # a template loop inside an allowed key is a value the template may print, never a template
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, extra_body={
        "chat_template_kwargs": {"enable_thinking": False, "note": LOOP}})
    assert r.usage.prompt_tokens == len(chat_ids(engine.tokenizer, msgs, None, {"enable_thinking": False}))


def test_the_render_stops_at_the_prompt_bound(server, engine, monkeypatch):
    """The checkpoint's own template looping over a request's value: the render stops once past the
    --max-prompt-tokens bound in bytes, before the template reaches its end (here a raise_exception)."""
    hostile = ("{% for i in range(n) %}{% for j in range(n) %}ab {% endfor %}{% endfor %}"
               "{{ raise_exception('rendered to the end') }}")
    monkeypatch.setattr(engine.tokenizer, "chat_template", hostile)
    r = _post(server.url, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                           "chat_template_kwargs": {"n": 1700}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "bytes" in err["message"], err
    assert "rendered to the end" not in err["message"]
    assert "tokens (--max-context)" in err["message"]
    r = _post(server.url, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                           "chat_template_kwargs": {"n": 3}})  # a short render reaches the end
    assert r.status_code == 400 and "rendered to the end" in r.json()["error"]["message"]


def test_tiny_temperature_and_top_p_are_greedy_in_cli_api_and_server(server, ckpt):
    """temperature 1e-40 overflows float32 logits; top_p 1e-300 is 0 in float32: both are the greedy pick
    (the limit of sampling as temperature -> 0; top-p keeps at least the most likely token)."""
    greedy = _cli_text(ckpt, "--prompt", PROMPT, "--max-tokens", "8", "--temp", "0")
    assert _cli_text(ckpt, "--prompt", PROMPT, "--max-tokens", "8", "--temp", "1e-40") == greedy
    assert _cli_text(ckpt, "--prompt", PROMPT, "--max-tokens", "8", "--temp", "1", "--top-p", "1e-300") == greedy
    c = server.client()
    msgs = [{"role": "user", "content": PROMPT}]
    for kw in ({"temperature": 1e-40}, {"temperature": 1, "top_p": 1e-300}):
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, **kw)
        assert r.choices[0].message.content == greedy, kw
        chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, stream=True, **kw))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == greedy


class Failing(Scripted):
    """The real model, raising a plain RuntimeError (no MoestreamError) at its ``fail_at``-th call."""

    def __init__(self, model, tokenizer, fail_at: int):
        super().__init__(model, tokenizer, "x")
        self.fail_at = fail_at

    def forward(self, ids, start, kv, all_logits=False):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected fault")
        return self.inner(ids, start, kv, all_logits)


@pytest.mark.parametrize("fail_at", [1, 3])  # in prefill, mid-decode
def test_any_exception_is_answered_in_openai_shape(server, engine, monkeypatch, fail_at):
    real = engine.model
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    monkeypatch.setattr(engine, "model", Failing(real, engine.tokenizer, fail_at))
    r = _post(server.url, body)
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and "injected fault" in err["message"]
    monkeypatch.setattr(engine, "model", Failing(real, engine.tokenizer, fail_at))
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    last = json.loads(events[-2])
    assert last["error"]["type"] == "server_error" and "injected fault" in last["error"]["message"]
    monkeypatch.setattr(engine, "model", Failing(real, engine.tokenizer, fail_at))
    c = server.client()
    with pytest.raises(openai.InternalServerError):
        c.completions.create(model="tiny", prompt="hi", max_tokens=8)
    monkeypatch.setattr(engine, "model", real)
    assert c.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=2).usage.completion_tokens


def test_metrics_label_routes_not_paths_and_models_retrieve(engine):
    import re
    import uuid

    srv = Server(create_app(engine, ServerOptions("tiny", max_context=512, api_key="s3cret")))
    try:
        key = {"Authorization": "Bearer s3cret"}
        for _ in range(30):
            httpx.get(f"{srv.url}/v1/{uuid.uuid4().hex}")  # 401: no key
            httpx.post(f"{srv.url}/v1/{uuid.uuid4().hex}/x", headers=key)  # 404
        assert httpx.get(srv.url + "/v1/models", headers=key).status_code == 200
        c = srv.client("s3cret")
        m = c.models.retrieve("tiny")
        assert m.id == "tiny" and m.object == "model"
        with pytest.raises(openai.NotFoundError) as e:
            c.models.retrieve("not-this-one")
        assert e.value.body["code"] == "model_not_found" and "not-this-one" in e.value.body["message"]
        text = httpx.get(srv.url + "/metrics").text
        labels = set(re.findall(r'^moestream_requests_total\{endpoint="([^"]*)"', text, re.M))
        assert labels == {"/v1/models", "/v1/models/{model_id}", "unmatched"}, labels
        assert 'endpoint="unmatched",status="401"' in text and 'endpoint="unmatched",status="404"' in text
    finally:
        srv.stop()


def test_the_bearer_scheme_is_case_insensitive(engine):
    """RFC 7235: the auth scheme is case-insensitive, then one or more spaces; the key itself is exact."""
    srv = Server(create_app(engine, ServerOptions("tiny", max_context=512, api_key="s3cret")))
    try:
        for header, ok in (("Bearer s3cret", True), ("bearer s3cret", True), ("BEARER s3cret", True),
                           ("Bearer   s3cret", True), ("Basic s3cret", False), ("Bearers3cret", False),
                           ("bearer s3cre", False), ("bearer S3CRET", False), ("s3cret", False), ("", False)):
            r = httpx.get(srv.url + "/v1/models", headers={"Authorization": header} if header else {})
            assert r.status_code == (200 if ok else 401), (header, r.text)
    finally:
        srv.stop()


def test_serve_checks_its_address_before_loading(ckpt, monkeypatch, capsys):
    from moestream.cli import engine_args as cli

    monkeypatch.setattr(cli, "load_engine", lambda *a, **k: pytest.fail("the model was loaded before the bind"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(ckpt), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "in use" in err[0], err
    assert main(["serve", "--model", str(ckpt), "--host", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host" in err[0] and "no-such-host.invalid" in err[0], err
