#!/usr/bin/env python3
"""Drives a running `tern serve` with the official `openai` client (and raw httpx where the client would hide
the wire format). Run by crates/tern-server/tests/*.rs; exits non-zero with a message on the first failure.

  --suite real      a random-weight model: shapes, streaming, stop, max_tokens, seed, logprobs, every error class
  --suite scripted  ScriptedBackend servers: reasoning on/off, tool calls (stream and not), tool_choice, round trip
  --suite load      32 concurrent raw SSE clients, a third disconnecting mid-stream; then the server must go idle
"""

import argparse
import json
import threading
import time

import openai

try:
    import httpx
except ImportError:  # openai 3.x ships its HTTP client as httpx2
    import httpx2 as httpx


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def expect_error(status, fn, param=None, contains=None):
    """`fn` must fail with an OpenAI error of `status` (and `param`, and a message containing `contains`)."""
    try:
        fn()
    except openai.APIStatusError as e:
        check(e.status_code == status, f"expected {status}, got {e.status_code}: {e.body}")
        body = e.response.json()["error"]
        check(set(body) >= {"message", "type", "param", "code"}, f"error shape: {body}")
        if param is not None:
            check(body["param"] == param, f"expected param {param}: {body}")
        for c in contains or []:
            check(c in body["message"], f"expected {c!r} in {body['message']!r}")
        return body
    raise AssertionError(f"expected HTTP {status}, got success")


def raw_error(resp, status):
    check(resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text[:200]}")
    body = resp.json()["error"]
    check(set(body) >= {"message", "type", "param", "code"}, f"error shape: {body}")
    return body


def wait_ready(base, key=None, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became ready")


def real_suite(base, key):
    root = base.removesuffix("/v1")
    wait_ready(root)
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    user = [{"role": "user", "content": "Hello there"}]

    # Non-streaming chat.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=6, temperature=0)
    check(r.object == "chat.completion" and len(r.choices) == 1, r)
    check(r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 0, r.usage)
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage)
    check(r.usage.prompt_tokens_details.cached_tokens is not None, r.usage)
    check(r.choices[0].finish_reason in ("length", "stop"), r.choices[0])
    # Content parts and max_completion_tokens.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    r2 = client.chat.completions.create(model=model, messages=parts, max_completion_tokens=6, temperature=0)
    check(r2.usage.prompt_tokens == r.usage.prompt_tokens, "text parts render like the joined string")
    check(r2.choices[0].message.reasoning_content == r.choices[0].message.reasoning_content, "greedy repeats")

    # max_tokens: exactly that many tokens unless a stop id came first.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=5, temperature=0)
    check(r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length", r)

    # Streaming with usage.
    chunks = list(client.chat.completions.create(model=model, messages=user, max_tokens=7, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    check(chunks[0].choices[0].delta.role == "assistant", chunks[0])
    check(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7, chunks[-1])
    check(chunks[-2].choices[0].finish_reason == "length", chunks[-2])
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks if c.choices)
    whole = client.chat.completions.create(model=model, messages=user, max_tokens=7, temperature=0)
    check(streamed == (whole.choices[0].message.reasoning_content or ""), "stream and non-stream agree")

    # Completions: string prompt, token-id prompt, stop strings.
    c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0)
    text = c.choices[0].text
    check(c.object == "text_completion" and c.usage.completion_tokens > 0, c)
    ids = httpx.post(f"{root}/tokenize", json={"prompt": "The capital of France is"},
                     headers={"Authorization": f"Bearer {key}"}).json()["tokens"]
    c2 = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0)
    check(c2.choices[0].text == text, "token-id prompt = string prompt")
    detok = httpx.post(f"{root}/detokenize", json={"tokens": ids}, headers={"Authorization": f"Bearer {key}"})
    check(detok.json()["prompt"] == "The capital of France is", detok.text)
    if c.choices[0].finish_reason == "length" and len(text) >= 6:
        stop = text[len(text) // 2:len(text) // 2 + 2]
        c3 = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0, stop=[stop, "zzzz"])
        check(c3.choices[0].text == text[:text.find(stop)], f"stop {stop!r}: {c3.choices[0].text!r} vs {text!r}")
        check(c3.choices[0].finish_reason == "stop", c3.choices[0])

    # Seeded sampling is deterministic.
    def sample(seed):
        return client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=1.0,
                                         seed=seed).choices[0].text
    check(sample(7) == sample(7), "same seed, same text")

    # Logprobs.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=3, logprobs=True, top_logprobs=2,
                                       temperature=0)
    lp = r.choices[0].logprobs.content
    check(len(lp) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp), lp)

    # Error classes.
    ctx = client.models.list().data[0].model_extra["max_model_len"]
    chat = client.chat.completions.create
    expect_error(400, lambda: chat(model=model, messages=user, temperature="hot"), "temperature")
    expect_error(400, lambda: chat(model=model, messages=user, temperature=5), "temperature")
    expect_error(400, lambda: chat(model=model, messages=user, max_tokens=0), "max_tokens")
    expect_error(400, lambda: chat(model=model, messages=user, top_p=1.5), "top_p")
    expect_error(400, lambda: chat(model=model, messages=user, stop=7), "stop")
    expect_error(400, lambda: chat(model=model, messages="hi"), "messages")
    expect_error(400, lambda: chat(model=model, messages=[]), "messages")
    expect_error(400, lambda: chat(model=model, messages=[{"role": "wizard", "content": "x"}]))
    expect_error(400, lambda: chat(model=model, messages=[{"role": "system", "content": "only system"}]))
    expect_error(400, lambda: chat(model=model, messages=user, max_tokens=ctx + 10), "max_tokens",
                 [str(ctx), str(ctx + 10)])
    expect_error(400, lambda: chat(model=model, messages=user, n=17), "n", ["16"])
    expect_error(400, lambda: chat(model=model, messages=user, response_format={"type": "xml"}), "response_format")
    expect_error(400, lambda: chat(model=model, messages=user, tool_choice="required"), "tool_choice")
    expect_error(404, lambda: chat(model="no-such-model", messages=user), "model")
    bad_key = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    expect_error(401, lambda: bad_key.chat.completions.create(model=model, messages=user))
    expect_error(400, lambda: client.completions.create(model=model, prompt=[["a"]]), "prompt")
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    body = raw_error(httpx.post(f"{base}/chat/completions", content=b'{"messages": [', headers=auth), 400)
    check("invalid JSON" in body["message"], body)
    raw_error(httpx.post(f"{base}/chat/completions", content=b"[1, 2]", headers=auth), 400)
    raw_error(httpx.get(f"{base}/no/such/route", headers=auth), 404)
    raw_error(httpx.get(f"{base}/chat/completions", headers=auth), 405)
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}'
    raw_error(httpx.post(f"{base}/chat/completions", content=big, headers=auth, timeout=60), 413)

    # Still serving.
    check(httpx.get(f"{root}/health").status_code == 200, "health after errors")
    r = client.chat.completions.create(model=model, messages=user, max_tokens=2)
    check(r.usage.completion_tokens <= 2, r)
    check(httpx.get(f"{root}/metrics").status_code == 401, "/metrics is behind the key")
    metrics = httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    for name in ("tern_requests_total", "tern_prompt_tokens_total", "tern_completion_tokens_total",
                 "tern_time_to_first_token_seconds_sum", "tern_decode_tokens_per_second", "tern_queue_depth"):
        check(name in metrics, f"{name} in /metrics")


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def scripted_suite(base, content_base, forced_base):
    """`base` replies (after the prompt's "<think>\\n") "plan\\n</think>\\n\\n<tool_call>...get_weather(city=Paris)...</tool_call>";
    `content_base` replies "Sunny in Paris.\\n\\n<tool_call>...</tool_call>" (for thinking off); `forced_base`
    replies the call alone (what a grammar-forced call allows)."""
    for b in (base, content_base, forced_base):
        wait_ready(b.removesuffix("/v1"))
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    chat = client.chat.completions.create
    model = client.models.list().data[0].id

    # Reasoning on (the default) with a tool call.
    r = chat(model=model, messages=ASK, tools=WEATHER)
    m = r.choices[0].message
    check(m.model_extra["reasoning_content"] == "plan" and m.model_extra["reasoning"] == "plan", m)
    check(m.content is None and len(m.tool_calls) == 1, m)
    call = m.tool_calls[0]
    check(call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}, call)
    check(call.id.startswith("call") and r.choices[0].finish_reason == "tool_calls", r)

    # The same, streamed: reasoning deltas, then the call's id and name, then its arguments in pieces.
    chunks = list(chat(model=model, messages=ASK, tools=WEATHER, stream=True))
    check(chunks[0].choices[0].delta.role == "assistant", chunks[0])
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    check(reasoning == "plan", reasoning)
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    check(len(deltas) >= 3 and all(d.index == 0 for d in deltas), deltas)
    check(deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call")
          and deltas[0].function.arguments == "", deltas[0])
    check(all(d.function.name is None and d.id is None for d in deltas[1:]), "the name comes once, first")
    check(json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}, deltas)
    check(chunks[-1].choices[0].finish_reason == "tool_calls", chunks[-1])
    # tool_choice "required" with thinking on: the grammar starts after </think>; the scripted call follows it.
    r = chat(model=model, messages=ASK, tools=WEATHER, tool_choice="required")
    m = r.choices[0].message
    check(m.model_extra["reasoning_content"] == "plan" and len(m.tool_calls) == 1, m)
    check(json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}, m)

    # Round trip: the call and its result go back in; the template renders them.
    history = ASK + [{"role": "assistant", "content": None, "reasoning_content": "plan",
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22C"}]
    r = chat(model=model, messages=history, tools=WEATHER)
    check(r.choices[0].message.tool_calls[0].function.name == "get_weather", r)
    tokens = httpx.post(f"{base.removesuffix('/v1')}/tokenize", json={"messages": history, "tools": WEATHER}).json()
    check(tokens["count"] > 20, tokens)

    # tool_choice "none": no tools offered, so the call comes back as text.
    r = chat(model=model, messages=ASK, tools=WEATHER, tool_choice="none")
    m = r.choices[0].message
    check(not m.tool_calls and "<function=get_weather>" in m.content and r.choices[0].finish_reason == "stop", m)
    # A call to a function that was not offered is content too.
    other = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    r = chat(model=model, messages=ASK, tools=other)
    check(not r.choices[0].message.tool_calls and "get_weather" in r.choices[0].message.content, r)
    expect_error(400, lambda: chat(model=model, messages=ASK, tools=WEATHER,
                                   tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice")
    expect_error(400, lambda: chat(model=model, messages=ASK, tools=[{"type": "function"}]), "tools")

    # Reasoning off: content and a call, no reasoning.
    off = openai.OpenAI(base_url=content_base, api_key="none", max_retries=0, timeout=60)
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    r = off.chat.completions.create(model=model, messages=ASK, tools=WEATHER, **kw)
    m = r.choices[0].message
    check(m.content == "Sunny in Paris." and m.model_extra.get("reasoning_content") is None, m)
    check(len(m.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls", m)
    chunks = list(off.chat.completions.create(model=model, messages=ASK, tools=WEATHER, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(content == "Sunny in Paris.", content)
    check(not any((c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks), chunks)
    # Without tools the call is text.
    r = off.chat.completions.create(model=model, messages=ASK, **kw)
    check(r.choices[0].message.content.startswith("Sunny in Paris.") and not r.choices[0].message.tool_calls, r)

    # A named tool_choice with thinking off: the reply is constrained to a call of that function.
    forced = openai.OpenAI(base_url=forced_base, api_key="none", max_retries=0, timeout=60)
    r = forced.chat.completions.create(model=model, messages=ASK, tools=WEATHER + other, **kw,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0].message
    check(len(m.tool_calls) == 1 and json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}, m)
    # parallel_tool_calls false: the reply ends with its first call.
    r = forced.chat.completions.create(model=model, messages=ASK, tools=WEATHER, parallel_tool_calls=False, **kw)
    check(len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls", r)


def metrics(root):
    return {k: float(v) for k, v in (line.split(" ", 1) for line in httpx.get(f"{root}/metrics").text.splitlines()
                                      if line and not line.startswith("#"))}


def load_suite(root, clients=32, max_tokens=32):
    wait_ready(root)
    model = httpx.get(f"{root}/v1/models").json()["data"][0]["id"]
    failures, done = [], []
    generated_before = metrics(root)["tern_completion_tokens_total"]

    def one(i):
        disconnect = i % 3 == 0
        body = {"model": model, "messages": [{"role": "user", "content": f"client {i}"}], "stream": True,
                "max_tokens": max_tokens, "stream_options": {"include_usage": True}, "seed": i}
        try:
            with httpx.stream("POST", f"{root}/v1/chat/completions", json=body, timeout=120) as resp:
                check(resp.status_code == 200, f"client {i}: HTTP {resp.status_code}")
                events = []
                for line in resp.iter_lines():
                    if not line:
                        continue
                    check(line.startswith("data: "), f"client {i}: bad SSE line {line!r}")
                    events.append(line[6:])
                    if disconnect and len(events) == 3:
                        return  # leaving the with-block closes the connection mid-stream
                check(events[-1] == "[DONE]", f"client {i}: no [DONE]")
                chunks = [json.loads(e) for e in events[:-1]]
                check(chunks[0]["choices"][0]["delta"]["role"] == "assistant", f"client {i}: first chunk")
                check(chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop"), f"client {i}: finish")
                n = chunks[-1]["usage"]["completion_tokens"]
                check(0 < n <= max_tokens, f"client {i}: usage {n}")
                done.append(n)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            failures.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    check(not failures, "; ".join(failures))
    check(len(done) == clients - (clients + 2) // 3, f"completed {len(done)}")
    # Cancelled requests must leave the engine: running and queued drop to 0.
    t0 = time.time()
    while True:
        m = metrics(root)
        if m["tern_requests_running"] == 0 and m["tern_queue_depth"] == 0:
            break
        check(time.time() - t0 < 30, f"server not idle: {m}")
        time.sleep(0.05)
    # A disconnected client's request stops within a few tokens, far short of max_tokens.
    dropped = clients - len(done)
    extra = m["tern_completion_tokens_total"] - generated_before - sum(done)
    check(extra <= dropped * max_tokens / 2, f"{dropped} disconnected requests generated {extra} tokens")
    check(httpx.get(f"{root}/health").status_code == 200, "health after load")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="http://HOST:PORT/v1")
    ap.add_argument("--suite", choices=["real", "scripted", "load"], default="real")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--content-url")
    ap.add_argument("--forced-url")
    a = ap.parse_args()
    if a.suite == "real":
        real_suite(a.base_url, a.api_key)
    elif a.suite == "scripted":
        scripted_suite(a.base_url, a.content_url, a.forced_url)
    else:
        load_suite(a.base_url.removesuffix("/v1"))
    print(f"test_openai.py --suite {a.suite}: ok")


if __name__ == "__main__":
    main()
