#!/usr/bin/env python3
"""Capture reference chat-template renders for tern-text's byte-equality test.

Renders a fixed set of conversations with transformers' own apply_chat_template
(the reference implementation) using the checkpoint's chat template, and writes
crates/tern-text/tests/data/chat_captures.json as a list of
{name, messages, tools, kwargs, rendered}.

Usage (no torch needed):
    pip install transformers==5.17.0 jinja2
    python3 tools/capture_chat_templates.py [MODEL_DIR]
MODEL_DIR defaults to $TERN_QWEN_DIR, else ../shared/qwen3.6-35b-a3b.
"""

import json
import os
import sys
from pathlib import Path

import transformers
from transformers import AutoTokenizer

PINNED = "5.17.0"
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "crates" / "tern-text" / "tests" / "data" / "chat_captures.json"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\" or <Zürich>"},
                "days": {"type": "integer", "minimum": 1},
                "metric": {"type": "boolean"},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Suche im Web — 検索 🔎",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "threshold": {"type": "number"},
            },
            "required": ["query"],
        },
    },
}


# A 1 x 1 PNG (the template never reads an image's data).
PNG_URL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"


def user(text):
    return {"role": "user", "content": text}


CASES = [
    ("plain", [user("Hello!")], None, {}),
    ("plain_no_generation_prompt", [user("Hello!")], None, {"add_generation_prompt": False}),
    (
        "system_prompt",
        [{"role": "system", "content": "  You are a terse assistant.\n"}, user("What is 2+2?")],
        None,
        {},
    ),
    (
        "multi_turn_reasoning",
        [
            {"role": "system", "content": "Be helpful."},
            user("Name a prime."),
            {"role": "assistant", "content": "7", "reasoning_content": "\nSmall primes: 2, 3, 5, 7.\n"},
            user("Another one?"),
            {"role": "assistant", "content": "11", "reasoning_content": "Next after 7 is 11."},
            user("Thanks"),
        ],
        None,
        {},
    ),
    (
        "inline_think_in_content",
        [
            user("Hi"),
            {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello there."},
            user("Bye"),
        ],
        None,
        {},
    ),
    ("tools_offered", [{"role": "system", "content": "You can call tools."}, user("Weather in Paris?")], [WEATHER_TOOL, SEARCH_TOOL], {}),
    ("tools_offered_no_system", [user("Weather in Paris?")], [WEATHER_TOOL], {}),
    (
        "tool_call_and_response",
        [
            user("Weather in Paris and Tokyo for 3 days? Also search news."),
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "I should call the tools.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "metric": True}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "days": 3}}},
                    {
                        "type": "function",
                        "function": {
                            "name": "search",
                            "arguments": {
                                "query": "news \"today\" <b>",
                                "filters": {"lang": "fr", "max": 5, "safe": False, "nested": {"x": [1, 2.5, None]}},
                                "tags": ["a", "ü", 3],
                                "threshold": 0.25,
                            },
                        },
                    },
                ],
            },
            {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
            {"role": "tool", "content": "{\"temp\": 18, \"sky\": \"rain\"}"},
            {"role": "tool", "content": "No news."},
        ],
        [WEATHER_TOOL, SEARCH_TOOL],
        {},
    ),
    (
        "tool_call_with_content_then_answer",
        [
            user("Weather in Oslo?"),
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
            },
            {"role": "tool", "content": "-3C, snow"},
            {"role": "assistant", "content": "It is -3°C and snowing in Oslo.", "reasoning_content": "Report it."},
            user("Thanks!"),
        ],
        [WEATHER_TOOL],
        {},
    ),
    ("thinking_off", [user("Quick answer: capital of France?")], None, {"enable_thinking": False}),
    ("thinking_on_explicit", [user("Capital of Spain?")], None, {"enable_thinking": True}),
    (
        "non_ascii_emoji",
        [
            {"role": "system", "content": "Réponds en français 🇫🇷."},
            user("¿Qué tal? 我想在apple工作 — нещо на Български 😶‍🌫️ 🦙"),
            {"role": "assistant", "content": "Très bien ✅", "reasoning_content": "Répondre poliment 🙂"},
            user("Encore «une» fois\ttab\\backslash"),
        ],
        None,
        {},
    ),
    (
        "content_text_parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "Part system."}]},
            {"role": "user", "content": [{"type": "text", "text": "First part. "}, {"type": "text", "text": "Second part."}]},
        ],
        None,
        {},
    ),
    # Images, as clients send them (OpenAI image_url parts) and as tern's server hands them to the template
    # ({"type": "image"} placeholders): each renders as <|vision_start|><|image_pad|><|vision_end|>.
    (
        "image_url_part",
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}, {"type": "text", "text": "What is in this picture?"}]}],
        None,
        {},
    ),
    (
        "image_placeholders_multi_turn",
        [
            {"role": "system", "content": "Describe images."},
            {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " and "}, {"type": "image"}, {"type": "text", "text": "."}]},
            {"role": "assistant", "content": "Two cats."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
        ],
        None,
        {"enable_thinking": False},
    ),
    (
        "image_in_tool_response",
        [
            user("Take a screenshot."),
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "screenshot", "arguments": {}}}]},
            {"role": "tool", "content": [{"type": "text", "text": "Screenshot taken:"}, {"type": "image_url", "image_url": {"url": PNG_URL}}]},
        ],
        [{"type": "function", "function": {"name": "screenshot", "description": "Capture the screen.", "parameters": {"type": "object", "properties": {}}}}],
        {},
    ),
    (
        "image_add_vision_id",
        [{"role": "user", "content": [{"type": "image"}, {"type": "image_url", "image_url": {"url": PNG_URL}}, {"type": "text", "text": "Same?"}]}],
        None,
        {"add_vision_id": True},
    ),
    (
        "extra_kwargs_ignored",
        [user("Hello")],
        None,
        {"preserve_thinking": True, "custom_flag": "x"},
    ),
]


def main():
    if transformers.__version__ != PINNED:
        sys.exit(f"need transformers=={PINNED}, found {transformers.__version__}")
    model_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TERN_QWEN_DIR", str(ROOT.parent / "shared" / "qwen3.6-35b-a3b"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    captures = []
    for name, messages, tools, kwargs in CASES:
        kw = dict(kwargs)
        add_gen = kw.pop("add_generation_prompt", True)
        rendered = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_gen, **kw
        )
        captures.append(
            {
                "name": name,
                "messages": messages,
                "tools": tools,
                "kwargs": dict(kwargs, add_generation_prompt=add_gen),
                "rendered": rendered,
            }
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(captures, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(captures)} captures to {OUT}")


if __name__ == "__main__":
    main()
