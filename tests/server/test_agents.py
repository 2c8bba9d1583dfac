#!/usr/bin/env python3
"""Issue 13 ("For agents and people") against a running `tern serve` on a random model with the real vocabulary,
driven by the official `openai` and `anthropic` clients (and raw httpx where the wire matters). Run by
crates/tern-server/tests/agents.rs; exits non-zero with a message on the first failure.

  --suite structured  response_format json_schema (strict and not) / json_object, a Lark grammar, forced tool calls
                      (required / named, parallel or not, thinking on and off): every reply, over several seeds,
                      streamed and not, parses and validates against its schema (jsonschema)
  --suite surface     n > 1, /v1/completions with a list of prompts and echo, text_offset, system_fingerprint,
                      unknown and unsupported fields named in a 400, x-api-key, CORS preflight and headers, GET /
  --suite anthropic   /v1/messages with the anthropic client: plain, system, stream, thinking, stop_sequences,
                      tools round trip (stream and not), count_tokens, Anthropic-shaped errors
  --suite responses   /v1/responses with the openai client: plain, instructions and items, stream events,
                      function call round trip, json_schema text format, 400 for what is not supported
"""

import argparse
import json
import time

import anthropic
import jsonschema
import openai

try:
    import httpx
except ImportError:  # openai 3.x ships its HTTP client as httpx2
    import httpx2 as httpx

THINK_END = 248069  # </think>


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def wait_ready(root, timeout=90):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became ready")


def expect_status(fn, status):
    try:
        fn()
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        check(e.status_code == status, f"expected {status}, got {e.status_code}: {e.body}")
        return e
    raise AssertionError(f"expected HTTP {status}, got success")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "active", "score", "address"],
    "additionalProperties": False,
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "Give me the data."}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def stream_chat(client, **kw):
    """(content, reasoning, calls, finish) of a streamed chat reply; calls assembled from their deltas."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    check(tc.id and tc.function.name, f"a call's first delta names it: {tc}")
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def structured_suite(base, key):
    root = base.removesuffix("/v1")
    wait_ready(root)
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create
    checked = 0

    # json_schema, strict and not, streamed and not, thinking off and on (the constraint starts after </think>;
    # the bias makes the random model close its reasoning at once).
    for seed in range(4):
        for strict in (True, False):
            for stream in (False, True):
                for thinking in (False, True):
                    extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
                    if thinking:
                        extra["logit_bias"] = {str(THINK_END): 100}
                    kw = dict(model=model, messages=ASK, max_tokens=300, seed=seed, temperature=1.0,
                              response_format={"type": "json_schema",
                                               "json_schema": {"name": "person", "schema": PERSON, "strict": strict}},
                              extra_body=extra)
                    if stream:
                        content, _, _, finish = stream_chat(client, **kw)
                    else:
                        r = chat(**kw)
                        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
                    check(finish == "stop", f"seed {seed} strict {strict} stream {stream}: {finish}: {content!r}")
                    jsonschema.validate(json.loads(content), PERSON)
                    checked += 1
    # json_object: any object; the bias on closing tokens ends the random model's strings.
    ids = httpx.post(f"{root}/tokenize", json={"prompt": '"}]'}, headers={"Authorization": f"Bearer {key}"})
    closing = {str(i): 12 for i in ids.json()["tokens"]}
    for t in ('"', "}", "]", '"}'):
        for i in httpx.post(f"{root}/tokenize", json={"prompt": t},
                            headers={"Authorization": f"Bearer {key}"}).json()["tokens"]:
            closing[str(i)] = 12
    for seed in range(3):
        for stream in (False, True):
            kw = dict(model=model, messages=ASK, max_tokens=300, seed=seed, logit_bias=closing,
                      response_format={"type": "json_object"}, extra_body=OFF)
            content = stream_chat(client, **kw)[0] if stream else chat(**kw).choices[0].message.content
            check(isinstance(json.loads(content), dict), content)
            checked += 1
    # Several choices: each one valid.
    r = chat(model=model, messages=ASK, max_tokens=300, n=3, seed=11, extra_body=OFF,
             response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    check(len(r.choices) == 3, r)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    # A Lark grammar (chat and completions).
    lark = 'start: ("yes" | "no") ", " NUM\nNUM: /[1-9][0-9]{0,2}/\n'
    for seed in range(3):
        r = chat(model=model, messages=ASK, max_tokens=20, seed=seed, extra_body=dict(OFF, grammar=lark))
        text = r.choices[0].message.content
        a, n = text.split(", ")
        check(a in ("yes", "no") and 1 <= int(n) <= 999 and r.choices[0].finish_reason == "stop", text)
        c = client.completions.create(model=model, prompt="Answer:", max_tokens=20, seed=seed,
                                      extra_body={"response_format": {"type": "grammar", "grammar": lark}})
        check(c.choices[0].text.split(", ")[0] in ("yes", "no"), c.choices[0].text)
    # Forced tool calls: required (either tool) and named, parallel or not, stream and not, thinking on and off.
    for seed in range(4):
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            for parallel in (False, True):
                for stream in (False, True):
                    thinking = seed % 2 == 1
                    extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
                    if thinking:
                        extra["logit_bias"] = {str(THINK_END): 100}
                    kw = dict(model=model, messages=ASK, max_tokens=400, seed=seed, tools=[WEATHER, TIME],
                              tool_choice=choice, parallel_tool_calls=parallel, extra_body=extra)
                    if stream:
                        _, _, calls, finish = stream_chat(client, **kw)
                    else:
                        r = chat(**kw)
                        m = r.choices[0].message
                        finish = r.choices[0].finish_reason
                        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in m.tool_calls or []]
                    what = f"seed {seed} {choice} parallel {parallel} stream {stream}"
                    check(finish == "tool_calls" and calls, f"{what}: {finish} {calls}")
                    check(parallel or len(calls) == 1, f"{what}: parallel_tool_calls false: {calls}")
                    for call in calls:
                        if isinstance(choice, dict):
                            check(call["name"] == "get_time", f"{what}: {call}")
                        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
                        checked += 1
    # Bad schemas and grammars are the client's 400, naming the field.
    e = expect_status(lambda: chat(model=model, messages=ASK, extra_body={"grammar": "start: nope"}), 400)
    check(e.body["param"] == "grammar", e.body)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such"},
                                                  "strict": True}}
    e = expect_status(lambda: chat(model=model, messages=ASK, response_format=bad), 400)
    check(e.body["param"] == "response_format", e.body)
    e = expect_status(lambda: chat(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                   response_format={"type": "json_object"}), 400)
    m = httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    check("tern_constraint_masks_total" in m, "mask counters in /metrics")
    check("tern_state_memory_bytes" in m, "the backend's sequence state in /metrics")
    print(f"structured: {checked} constrained replies validated")


def surface_suite(base, key, cors_origin):
    root = base.removesuffix("/v1")
    wait_ready(root)
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    user = [{"role": "user", "content": "Hello"}]
    auth = {"Authorization": f"Bearer {key}"}

    # n > 1: several choices of one prompt, non-streamed and streamed; the usage counts the prompt once.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=5, n=3, seed=1, extra_body=OFF)
    check([c.index for c in r.choices] == [0, 1, 2], r)
    check(r.usage.completion_tokens == sum(1 for _ in r.choices) * 5 or r.usage.completion_tokens <= 15, r.usage)
    one = client.chat.completions.create(model=model, messages=user, max_tokens=5, n=1, seed=1, extra_body=OFF)
    check(r.usage.prompt_tokens == one.usage.prompt_tokens, "the prompt counts once")
    check(r.system_fingerprint and r.system_fingerprint.startswith("tern-"), r.system_fingerprint)
    texts = {}
    finishes = {}
    for chunk in client.chat.completions.create(model=model, messages=user, max_tokens=5, n=2, seed=3, stream=True,
                                                stream_options={"include_usage": True}, extra_body=OFF):
        check(chunk.system_fingerprint == r.system_fingerprint, chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if chunk.usage:
            check(chunk.usage.completion_tokens == 10, chunk.usage)
    check(sorted(texts) == [0, 1] and sorted(finishes) == [0, 1], (texts, finishes))
    # Completions: a list of prompts (x n), echo, logprobs with text_offset.
    c = client.completions.create(model=model, prompt=["The sky", "A cat"], max_tokens=4, n=2, temperature=0)
    check([x.index for x in c.choices] == [0, 1, 2, 3], c)
    check(c.choices[0].text == c.choices[1].text and c.system_fingerprint.startswith("tern-"), "greedy x2 agree")
    e = client.completions.create(model=model, prompt="The sky", max_tokens=4, temperature=0, echo=True)
    check(e.choices[0].text == "The sky" + c.choices[0].text, (e.choices[0].text, c.choices[0].text))
    lp = client.completions.create(model=model, prompt="The sky", max_tokens=6, temperature=0, logprobs=2)
    l0 = lp.choices[0].logprobs
    check(len(l0.tokens) == 6 and len(l0.text_offset) == 6 and l0.text_offset[0] == 0, l0)
    for i in range(1, 6):
        check(l0.text_offset[i] == l0.text_offset[i - 1] + len(l0.tokens[i - 1]), l0.text_offset)
    offsets = []
    for chunk in client.completions.create(model=model, prompt="The sky", max_tokens=6, temperature=0, logprobs=2,
                                           stream=True):
        if chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
    check(offsets == l0.text_offset, (offsets, l0.text_offset))
    # Unknown and unsupported fields: a 400 naming the field.
    for field, value in (("suffix", "x"), ("functions", [{"name": "f"}]), ("frobnicate", 1)):
        body = {"model": model, "messages": user, field: value}
        resp = httpx.post(f"{base}/chat/completions", json=body, headers=auth)
        check(resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text)
        check(field in resp.json()["error"]["message"], resp.text)
    resp = httpx.post(f"{base}/completions", json={"model": model, "prompt": "x", "suffix": "y"}, headers=auth)
    check(resp.status_code == 400 and resp.json()["error"]["param"] == "suffix", resp.text)
    resp = httpx.post(f"{base}/completions", json={"prompt": "x", "echo": True, "logprobs": 1}, headers=auth)
    check(resp.status_code == 400 and resp.json()["error"]["param"] == "echo", resp.text)
    # x-api-key is a key too; a wrong one is refused.
    check(httpx.get(f"{base}/models", headers={"x-api-key": key}).status_code == 200, "x-api-key")
    check(httpx.get(f"{base}/models", headers={"x-api-key": "wrong"}).status_code == 401, "wrong x-api-key")
    # CORS: a preflight from the allowed origin is answered without the key; replies carry the header; other
    # origins get none.
    pre = httpx.options(f"{base}/chat/completions", headers={
        "Origin": cors_origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    check(pre.status_code in (200, 204) and pre.headers.get("access-control-allow-origin") == cors_origin, pre.headers)
    check("authorization" in pre.headers.get("access-control-allow-headers", "").lower(), pre.headers)
    resp = httpx.post(f"{base}/chat/completions", json={"messages": user, "max_tokens": 1},
                      headers=dict(auth, Origin=cors_origin))
    check(resp.status_code == 200 and resp.headers.get("access-control-allow-origin") == cors_origin, resp.headers)
    resp = httpx.post(f"{base}/chat/completions", json={"messages": user, "max_tokens": 1},
                      headers=dict(auth, Origin="http://elsewhere.example"))
    check("access-control-allow-origin" not in resp.headers, resp.headers)
    resp = httpx.get(f"{base}/models", headers={"Origin": cors_origin})
    check(resp.status_code == 401 and resp.headers.get("access-control-allow-origin") == cors_origin,
          "errors carry the CORS header")
    # The chat page needs no key and loads nothing from elsewhere.
    page = httpx.get(f"{root}/")
    check(page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.headers)
    check("<title>tern</title>" in page.text and "http://" not in page.text and "https://" not in page.text,
          "self-contained page")


def anthropic_suite(root, key):
    wait_ready(root)
    client = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=120)
    user = [{"role": "user", "content": "Hello there"}]
    off = {"type": "disabled"}

    # Plain, non-streaming: a text block, usage, a stop reason. Any model name is served.
    greedy = {"temperature": 0}  # (this SDK no longer has the parameter; Claude Code and older SDKs send it)
    r = client.messages.create(model="any-model-name", max_tokens=8, messages=user, thinking=off,
                               extra_body=greedy)
    check(r.type == "message" and r.role == "assistant" and r.content and r.content[0].type == "text", r)
    check(r.stop_reason in ("max_tokens", "end_turn") and r.usage.output_tokens <= 8 and r.usage.input_tokens > 0, r)
    if r.stop_reason == "max_tokens":
        check(r.usage.output_tokens == 8, r.usage)
    # System: a longer prompt; count_tokens agrees with the usage.
    s = client.messages.create(model="m", max_tokens=4, messages=user, system="Be terse.", thinking=off)
    check(s.usage.input_tokens > r.usage.input_tokens, (s.usage, r.usage))
    n = client.messages.count_tokens(model="m", messages=user, system="Be terse.", thinking=off)
    check(n.input_tokens == s.usage.input_tokens, (n, s.usage))
    sys_blocks = client.messages.create(model="m", max_tokens=4, messages=user, thinking=off,
                                        system=[{"type": "text", "text": "Be terse."}])
    check(sys_blocks.usage.input_tokens == s.usage.input_tokens, "system as blocks = as a string")
    # Streaming: the SDK's event sequence and its final message; the same text as the non-streamed greedy reply.
    with client.messages.stream(model="m", max_tokens=8, messages=user, thinking=off, extra_body=greedy) as st:
        streamed = "".join(st.text_stream)
        final = st.get_final_message()
    check(streamed == r.content[0].text and final.content[0].text == streamed, (streamed, r.content[0].text))
    check(final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens, final)
    raw = httpx.post(f"{root}/v1/messages", headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                     json={"model": "m", "max_tokens": 3, "messages": user, "stream": True, "thinking": off})
    kinds = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    check(kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds)
    check("content_block_start" in kinds and "content_block_delta" in kinds and "content_block_stop" in kinds, kinds)
    # Thinking: enabled with a budget is a thinking block (closed by the budget), then text.
    t = client.messages.create(model="m", max_tokens=20, messages=user, extra_body=greedy,
                               thinking={"type": "enabled", "budget_tokens": 4})
    check(t.content[0].type == "thinking" and t.content[0].thinking, t.content)
    check(len(t.content) >= 2 and t.content[1].type == "text", t.content)
    # stop_sequences: cut where the greedy text has it.
    long = client.messages.create(model="m", max_tokens=16, messages=user, thinking=off, extra_body=greedy)
    text = long.content[0].text
    if len(text) > 8:
        stop = text[4:7]
        cut = client.messages.create(model="m", max_tokens=16, messages=user, thinking=off, extra_body=greedy,
                                     stop_sequences=[stop])
        check(cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, cut)
        check(cut.content[0].text == text[:text.find(stop)], (cut.content, text))
    # Tools round trip: a forced call (its input follows the input_schema), then the result back.
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    call = client.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "Weather?"}],
                                  tools=tools, thinking=off,
                                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    uses = [b for b in call.content if b.type == "tool_use"]
    check(call.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", call)
    jsonschema.validate(uses[0].input, tools[0]["input_schema"])
    check(uses[0].id.startswith("toolu_"), uses[0].id)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": [b.model_dump() for b in call.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": "sunny, 22C"}]}]
    after = client.messages.create(model="m", max_tokens=6, messages=history, tools=tools, thinking=off)
    check(after.usage.input_tokens > call.usage.input_tokens and after.content, after)
    # The same call streamed: input_json_delta pieces make the same input.
    with client.messages.stream(model="m", max_tokens=200, messages=[{"role": "user", "content": "Weather?"}],
                                tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                thinking=off) as st:
        final = st.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    check(final.stop_reason == "tool_use" and uses, final)
    jsonschema.validate(uses[0].input, tools[0]["input_schema"])
    # Errors in Anthropic's shape.
    e = expect_status(lambda: client.messages.create(model="m", max_tokens=4, messages=[]), 400)
    check(isinstance(e, anthropic.BadRequestError) and e.body["type"] == "error", e.body)
    check(e.body["error"]["type"] == "invalid_request_error", e.body)
    bad = anthropic.Anthropic(base_url=root, api_key="wrong", max_retries=0)
    e = expect_status(lambda: bad.messages.create(model="m", max_tokens=4, messages=user), 401)
    check(isinstance(e, anthropic.AuthenticationError) and e.body["error"]["type"] == "authentication_error", e.body)
    e = expect_status(lambda: client.messages.create(model="m", max_tokens=4, messages=user,
                                                     extra_body={"top_k": "x"}), 400)
    # Structured output (output_config.format): the text block follows the schema.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    so = client.messages.create(model="m", max_tokens=30, messages=user, thinking=off,
                                output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(so.content[0].text), schema)
    resp = httpx.post(f"{root}/v1/messages", headers={"x-api-key": key}, json={"model": "m", "messages": user})
    check(resp.status_code == 400 and "max_tokens" in resp.json()["error"]["message"], resp.text)


def responses_suite(base, key):
    root = base.removesuffix("/v1")
    wait_ready(root)
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    none = {"effort": "none"}

    # Plain: text in, a message out (output_text is the SDK's join of it), usage.
    r = client.responses.create(model=model, input="Hello", max_output_tokens=8, reasoning=none, temperature=0)
    check(r.object == "response" and r.status in ("completed", "incomplete"), r)
    check(isinstance(r.output_text, str) and r.usage.output_tokens <= 8 and r.usage.input_tokens > 0, r)
    check(r.status == "completed" or r.incomplete_details.reason == "max_output_tokens", r)
    # Instructions and items.
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]
    r2 = client.responses.create(model=model, input=items, instructions="Be terse.", max_output_tokens=4,
                                 reasoning=none)
    check(r2.usage.input_tokens > r.usage.input_tokens, (r2.usage, r.usage))
    # Reasoning (thinking on) comes back as a reasoning item before the message.
    t = client.responses.create(model=model, input="Hello", max_output_tokens=6)
    check(t.output[0].type == "reasoning" and t.output[0].content[0].text, t.output)
    # Streaming: the events the SDK reads, deltas adding up to the final text.
    events = list(client.responses.create(model=model, input="Hello", max_output_tokens=8, reasoning=none,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    check(kinds[:2] == ["response.created", "response.in_progress"], kinds)
    check(kinds[-1] in ("response.completed", "response.incomplete"), kinds)
    check("response.output_item.added" in kinds and "response.output_text.delta" in kinds, kinds)
    check([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(text == r.output_text and events[-1].response.output_text == text, (text, r.output_text))
    # Structured text format, with the SDK's stream helper (a completed response).
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    with client.responses.stream(model=model, input="Answer", max_output_tokens=50, reasoning=none, text=fmt) as st:
        final = st.get_final_response()
    check(final.status == "completed", final)
    jsonschema.validate(json.loads(final.output_text), schema)
    # Function call round trip.
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": WEATHER["function"]["parameters"]}]
    fc = client.responses.create(model=model, input="Weather?", tools=tools, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, reasoning=none)
    calls = [o for o in fc.output if o.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id, fc.output)
    jsonschema.validate(json.loads(calls[0].arguments), tools[0]["parameters"])
    back = [{"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 22C"}]
    after = client.responses.create(model=model, input=back, tools=tools, max_output_tokens=6, reasoning=none)
    check(after.usage.input_tokens > fc.usage.input_tokens, (after.usage, fc.usage))
    # Streamed function call: arguments deltas, done with the whole arguments.
    events = list(client.responses.create(model=model, input="Weather?", tools=tools, tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=200, reasoning=none,
                                          stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    check(done and done[0].arguments == deltas, (deltas, done))
    jsonschema.validate(json.loads(deltas), tools[0]["parameters"])
    # What needs state is refused by name.
    for field, value in (("previous_response_id", "resp_1"), ("store", True), ("background", True)):
        e = expect_status(lambda: client.responses.create(model=model, input="x", **{field: value}), 400)
        check(e.body["param"] == field and field in e.body["message"], e.body)
    e = expect_status(lambda: client.responses.create(model=model, input="x", tools=[{"type": "web_search"}]), 400)
    check(e.body["param"] == "tools", e.body)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="http://HOST:PORT/v1")
    ap.add_argument("--suite", choices=["structured", "surface", "anthropic", "responses", "all"], default="all")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--cors-origin", default="http://page.example")
    a = ap.parse_args()
    suites = ["structured", "surface", "anthropic", "responses"] if a.suite == "all" else [a.suite]
    for s in suites:
        t0 = time.time()
        if s == "structured":
            structured_suite(a.base_url, a.api_key)
        elif s == "surface":
            surface_suite(a.base_url, a.api_key, a.cors_origin)
        elif s == "anthropic":
            anthropic_suite(a.base_url.removesuffix("/v1"), a.api_key)
        else:
            responses_suite(a.base_url, a.api_key)
        print(f"test_agents.py --suite {s}: ok ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
