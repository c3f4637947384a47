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
from torch import nn

from moestream.cli import _add_generate_args, main, run_generate
from moestream.engine import load
from moestream.server import ServerOptions, create_app
from moestream.tokenizer import chat_ids

from .helpers import write_tiny_synth_config

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


class Scripted(nn.Module):
    """The real model, with the next token of ``script`` made certain at each call (to test text handling)."""

    def __init__(self, model, tokenizer, script: str):
        super().__init__()
        self.inner = model
        self.ids = tokenizer.encode(script, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.calls = 0

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

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
