"""A tool-call round trip through the official openai client: the model calls
get_weather, the client answers with the tool's result, the model answers in
text; whole and streamed (delta.tool_calls assembled as clients do). The
final turn asks for text with tool_choice "none" (Qwen2.5-Coder 0.5B, left to
choose, calls the tool again); the same turn with tools on must come back
well formed either way.
Usage: openai_tools_e2e.py BASE_URL MODEL_ID"""

import json
import sys

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}]
RESULT = json.dumps({"temperature": 21, "sky": "clear"})


def check_call(calls):
    assert calls and len(calls) == 1, calls
    call = calls[0]
    assert call.id.startswith("call_") and call.type == "function", call
    assert call.function.name == "get_weather", call
    assert json.loads(call.function.arguments) == {"city": "Paris"}, call.function.arguments
    return call


def next_turn(call):
    """The conversation after the call: the assistant's call and the tool's result."""
    return ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]


def streamed(client, model, messages, **extra):
    """Content, tool calls (assembled from delta.tool_calls) and finish reason of a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=48, stream=True, **extra
    ):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=120)

    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, first
    call = check_call(choice.message.tool_calls)
    print(f"call: {call.function.name}({call.function.arguments}) id {call.id}")

    answer = client.chat.completions.create(
        model=model, messages=next_turn(call), tools=TOOLS, tool_choice="none", temperature=0, max_tokens=48
    )
    text = answer.choices[0].message.content
    assert text and answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls, answer
    print(f"answer after the tool result: {text!r}")
    free = client.chat.completions.create(model=model, messages=next_turn(call), tools=TOOLS, temperature=0, max_tokens=48)
    calls = free.choices[0].message.tool_calls or []
    assert all(c.id.startswith("call_") and json.loads(c.function.arguments) is not None for c in calls), free
    assert (free.choices[0].finish_reason == "tool_calls") == bool(calls) or free.choices[0].finish_reason == "length"
    print(f"same turn, tools on: {len(calls)} call(s), content {free.choices[0].message.content!r}")

    content, calls, finish = streamed(client, model, ASK)
    assert finish == "tool_calls" and not content.strip(), (content, finish)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})], calls
    print(f"streamed call: {calls[0]['name']}({calls[0]['arguments']})")
    content, calls, finish = streamed(client, model, next_turn(call), tool_choice="none")
    assert content == text and not calls and finish == "stop", (content, text)
    print("streamed answer: the same text")

    try:
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=4, tools=[{"type": "function", "function": {"parameters": {}}}]
        )
        raise AssertionError("a tool without a name was accepted")
    except openai.BadRequestError as e:
        assert e.param == "tools[0].function", e.body
        print(f"tool without a name: 400 ({e.param})")
    print("openai client, tools: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
