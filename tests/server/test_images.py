#!/usr/bin/env python3
"""Images through every API, driven by the official `openai` and `anthropic` clients. Run by
crates/tern-server/tests/images.rs; exits non-zero with a message on the first failure.

  --suite limits     a vision-language model served with --max-images 3, --max-image-bytes 65536 and
                     --max-image-pixels 1000000: token counts of prompts with images (/tokenize, count_tokens), every
                     malformed, oversized or unsupported image a clear 400 naming what is wrong, in each API's error
                     shape; then a text request is still served
  --suite answers    the same server: an image in chat (plain and streamed), Responses, Messages, an OpenAI tool
                     message and an Anthropic tool_result get an answer, with the image tokens counted as prompt
                     tokens (needs the engine to read images)
  --suite text-only  a model without vision weights: an image part in each API is a 400 that says so
"""

import argparse
import base64
import io
import struct
import time
import zlib

import anthropic
import openai

try:
    import httpx
except ImportError:  # openai 3.x ships its HTTP client as httpx2
    import httpx2 as httpx


MODEL = "tern"  # the served model's id, read from /v1/models


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def png(w, h, seed=0):
    """A w x h RGB PNG of varied pixels, written with zlib alone (no imaging library needed)."""
    rows = b"".join(
        b"\x00" + bytes(((x * 7 + y * 13 + seed) % 256, (x * y + seed) % 256, (x ^ y) % 256)[c] for x in range(w) for c in range(3))
        for y in range(h)
    )

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def noise_png(w, h, seed=1):
    """A PNG that does not compress (for the byte limit)."""
    import random

    rng = random.Random(seed)
    rows = b"".join(b"\x00" + bytes(rng.randrange(256) for _ in range(3 * w)) for _ in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 0)) + chunk(b"IEND", b"")


def flat_png(w, h):
    """A w x h PNG of one colour: many pixels in few bytes (for the pixel limit)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    rows = (b"\x00" + b"\x80" * (3 * w)) * h
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def bomb_png(w, h):
    """A PNG header declaring w x h pixels with almost no data: must be refused before it is decoded."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 1000)) + chunk(b"IEND", b"")


def b64(data):
    return base64.b64encode(data).decode()


def data_url(data, media="image/png"):
    return f"data:{media};base64,{b64(data)}"


def image_part(data, media="image/png"):
    return {"type": "image_url", "image_url": {"url": data_url(data, media)}}


# 64 x 64: grid 4 x 4 patches of 16, merged 2 x 2: 4 image tokens. 128 x 96: 8 x 6 patches, 12 tokens.
SMALL, WIDE = png(64, 64), png(128, 96, seed=5)
SMALL_TOKENS, WIDE_TOKENS = 4, 12


def tokenize(root, key, messages):
    r = httpx.post(f"{root}/tokenize", json={"messages": messages}, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    check(r.status_code == 200, f"/tokenize: {r.status_code} {r.text[:300]}")
    return r.json()["tokens"]


def expect_openai_error(fn, contains, code=None, status=400):
    try:
        fn()
    except openai.APIStatusError as e:
        check(e.status_code == status, f"expected {status}, got {e.status_code}: {e.body}")
        body = e.response.json()["error"]
        check(set(body) >= {"message", "type", "param", "code"}, f"error shape: {body}")
        for c in contains:
            check(c in body["message"], f"expected {c!r} in {body['message']!r}")
        if code is not None:
            check(body["code"] == code, f"expected code {code}: {body}")
        return body
    raise AssertionError(f"expected HTTP {status}, got success ({contains})")


def expect_anthropic_error(fn, contains, status=400):
    try:
        fn()
    except anthropic.APIStatusError as e:
        check(e.status_code == status, f"expected {status}, got {e.status_code}: {e.body}")
        check(e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body)
        for c in contains:
            check(c in e.body["error"]["message"], f"expected {c!r} in {e.body['error']['message']!r}")
        return
    raise AssertionError(f"expected HTTP {status}, got success ({contains})")


def clients(root, key):
    oa = openai.OpenAI(base_url=f"{root}/v1", api_key=key, max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=root, api_key=key, max_retries=0, timeout=120)
    return oa, an


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def text(t):
    return {"type": "text", "text": t}


def limits_suite(root, key):
    oa, an = clients(root, key)
    # Token counts: each image is <|vision_start|>, its pads, <|vision_end|>, in place (counted before any decode).
    plain = tokenize(root, key, user(text("What is this?")))
    one = tokenize(root, key, user(image_part(SMALL), text("What is this?")))
    two = tokenize(root, key, user(image_part(SMALL), text("What is this?"), image_part(WIDE)))
    check(len(one) == len(plain) + 2 + SMALL_TOKENS, f"one image: {len(one)} vs {len(plain)}")
    check(len(two) == len(plain) + 4 + SMALL_TOKENS + WIDE_TOKENS, f"two images: {len(two)} vs {len(plain)}")
    pad = 248056
    check(one.count(pad) == SMALL_TOKENS and one[one.index(pad) - 1] == 248053, f"pads: {one}")
    check(two.count(pad) == SMALL_TOKENS + WIDE_TOKENS, "pads of two images")
    # Anthropic's count_tokens counts them the same way.
    msg = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(SMALL)}},
        {"type": "text", "text": "What is this?"}]}]
    counted = an.messages.count_tokens(model=MODEL, messages=msg).input_tokens
    plain_counted = an.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "What is this?"}]).input_tokens
    check(counted == plain_counted + 2 + SMALL_TOKENS, f"count_tokens: {counted} vs {plain_counted}")

    chat = lambda messages: oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    q = text("Describe it.")
    t0 = time.time()
    for part, contains, code in [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!notbase64"}}, ["image 1", "base64"], "invalid_image"),
        (image_part(b"this is not an image at all"), ["image 1", "PNG or JPEG"], "invalid_image"),
        (image_part(b"GIF89a" + b"\x00" * 32, "image/gif"), ["image/gif", "not supported"], "invalid_image"),
        (image_part(b"GIF89a\x01\x00\x01\x00" + b"\x00" * 32, ""), ["Gif", "not supported"], "invalid_image"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, ["not fetched", "data:"], "invalid_image"),
        ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}, ["not fetched"], "invalid_image"),
        ({"type": "image_url", "image_url": {}}, ["needs"], None),
        (image_part(SMALL[: len(SMALL) // 2]), ["image 1", "cannot be decoded"], "invalid_image"),
        (image_part(noise_png(160, 160)), ["--max-image-bytes", "65536"], "image_too_large"),
        (image_part(flat_png(1200, 1000)), ["1200x1000", "--max-image-pixels"], "image_too_large"),
        (image_part(bomb_png(100000, 100000)), ["100000x100000", "--max-image-pixels"], "image_too_large"),
        (image_part(png(600, 2)), ["aspect ratio"], "invalid_image"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, ["'input_audio' content parts are not supported"], None),
    ]:
        expect_openai_error(lambda: chat(user(part, q)), contains, code)
    check(time.time() - t0 < 30, "the refusals took too long (a bomb decoded?)")
    # Too many: the fourth image of the request, across messages.
    many = user(image_part(SMALL), image_part(SMALL)) + [{"role": "assistant", "content": "ok"}] + user(
        image_part(SMALL), image_part(WIDE), q)
    expect_openai_error(lambda: chat(many), ["at most 3 images", "--max-images"], "too_many_images")
    # A system message cannot hold one (the chat template's own rule).
    expect_openai_error(
        lambda: chat([{"role": "system", "content": [image_part(SMALL)]}] + user(q)), ["System message cannot contain images"])
    # An image after the text of a continued final message would be cut from the prompt: refused.
    r = httpx.post(f"{root}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60, json={
        "messages": user(q) + [{"role": "assistant", "content": [text("It is"), image_part(SMALL)]}],
        "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2})
    check(r.status_code == 400 and "placeholders" in r.json()["error"]["message"], f"continued: {r.status_code} {r.text[:300]}")

    # Responses: input_image with a bad URL, a file_id.
    resp = lambda content: oa.responses.create(model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=4)
    expect_openai_error(lambda: resp([{"type": "input_image", "image_url": "https://example.com/a.png"}]), ["not fetched"])
    expect_openai_error(lambda: resp([{"type": "input_image", "file_id": "file-123"}]), ["file_id", "not supported"])
    expect_openai_error(lambda: resp([{"type": "input_image", "image_url": data_url(b"garbage")}]), ["image 1"])

    # Anthropic: url and file sources, an unsupported media type, bad data, oversized, in a tool_result too.
    def messages(content):
        return an.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}])

    for src, contains in [
        ({"type": "url", "url": "https://example.com/a.png"}, ["not fetched"]),
        ({"type": "file", "file_id": "file_1"}, ["file sources"]),
        ({"type": "base64", "media_type": "image/webp", "data": b64(b"RIFF0000WEBP")}, ["image/webp", "not supported"]),
        ({"type": "base64", "media_type": "image/png", "data": "%%%"}, ["base64"]),
        ({"type": "base64", "media_type": "image/png", "data": b64(flat_png(1200, 1000))}, ["--max-image-pixels"]),
    ]:
        expect_anthropic_error(lambda: messages([{"type": "image", "source": src}, {"type": "text", "text": "Hi"}]), contains)
    tool_use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]}
    bad_result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(b"nope")}}]}]}
    expect_anthropic_error(
        lambda: an.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Look."}, tool_use, bad_result]),
        ["image 1"])

    # Still serving.
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    check(r.usage.completion_tokens >= 1, f"text after the refusals: {r}")
    check(httpx.get(f"{root}/health", timeout=10).status_code == 200, "health after the refusals")


def answers_suite(root, key):
    oa, an = clients(root, key)
    q = text("What is in this picture?")
    msgs = user(image_part(SMALL), q)
    want = len(tokenize(root, key, msgs))
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    check(r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1, f"chat: {r}")
    check(r.usage.prompt_tokens == want, f"chat usage {r.usage.prompt_tokens} != /tokenize {want}")
    # Deterministic for the same image, and the same again after the prefix cache holds it.
    again = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    check(again.choices[0].message == r.choices[0].message, "the same image, the same greedy reply")

    two = user(image_part(SMALL), text("and"), image_part(WIDE), q)
    stream = oa.chat.completions.create(model=MODEL, messages=two, max_tokens=4, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    check(chunks[-1].usage.prompt_tokens == len(tokenize(root, key, two)), f"stream usage: {chunks[-1].usage}")

    # An OpenAI tool message with an image (a screenshot tool).
    tool_msgs = [
        {"role": "user", "content": "Take a screenshot and describe it."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [text("Screenshot:"), image_part(WIDE)]},
    ]
    r = oa.chat.completions.create(model=MODEL, messages=tool_msgs, max_tokens=4)
    check(r.usage.prompt_tokens == len(tokenize(root, key, tool_msgs)), f"tool image usage: {r.usage}")

    # Responses.
    r = oa.responses.create(model=MODEL, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": data_url(SMALL), "detail": "auto"}]}])
    check(r.output and r.usage.input_tokens >= len(tokenize(root, key, user(q))) + 2 + SMALL_TOKENS, f"responses: {r}")

    # Anthropic Messages, and an image in a tool_result.
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(SMALL)}}
    m = an.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [img, {"type": "text", "text": "What is this?"}]}])
    counted = an.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [img, {"type": "text", "text": "What is this?"}]}])
    check(m.content and m.usage.input_tokens == counted.input_tokens, f"messages: {m.usage} vs {counted}")
    convo = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "Here it is:"}, img]}]},
    ]
    tools = [{"name": "screenshot", "description": "Capture the screen.", "input_schema": {"type": "object", "properties": {}}}]
    m = an.messages.create(model=MODEL, max_tokens=4, messages=convo, tools=tools)
    counted = an.messages.count_tokens(model=MODEL, messages=convo, tools=tools)
    check(m.content and m.usage.input_tokens == counted.input_tokens, f"tool_result image: {m.usage} vs {counted}")


def text_only_suite(root, key):
    oa, an = clients(root, key)
    q = text("What is this?")
    expect_openai_error(lambda: oa.chat.completions.create(model=MODEL, messages=user(image_part(SMALL), q), max_tokens=2),
                        ["does not read images"], "images_unsupported")
    expect_openai_error(lambda: oa.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(SMALL)}]}]), ["does not read images"])
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(SMALL)}}
    expect_anthropic_error(lambda: an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [img]}]),
                           ["does not read images"])
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    check(r.usage.completion_tokens >= 1, "text still served")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="http://HOST:PORT")
    ap.add_argument("--suite", choices=["limits", "answers", "text-only"], required=True)
    ap.add_argument("--api-key", default="none")
    a = ap.parse_args()
    t0 = time.time()
    while httpx.get(f"{a.root}/health", timeout=5).status_code != 200:
        check(time.time() - t0 < 120, "the server never became ready")
        time.sleep(0.1)
    global MODEL
    MODEL = httpx.get(f"{a.root}/v1/models", headers={"Authorization": f"Bearer {a.api_key}"}, timeout=10).json()["data"][0]["id"]
    {"limits": limits_suite, "answers": answers_suite, "text-only": text_only_suite}[a.suite](a.root, a.api_key)
    print(f"test_images.py --suite {a.suite}: ok")


if __name__ == "__main__":
    main()
