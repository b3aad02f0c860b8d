"""The server through the official openai client: chat (whole and streamed),
log-probabilities, text completions, stop sequences, seeds, usage, and errors
as the client's exception types. Usage: openai_e2e.py BASE_URL MODEL_ID"""

import sys

import openai


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant", whole
    assert text and whole.choices[0].finish_reason in ("stop", "length"), whole
    u = whole.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    print(f"chat: {text!r} ({u.completion_tokens} tokens, {whole.choices[0].finish_reason})")

    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == text, ("".join(pieces), text)
    assert finish == whole.choices[0].finish_reason and usage.completion_tokens == u.completion_tokens
    print(f"stream: {len(pieces)} chunks, same text, finish {finish}")

    # Log-probabilities: one entry per token, whole and streamed alike.
    lp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2
    )
    entries = lp.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == lp.choices[0].message.content == text, entries
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token and e.logprob <= 0 for e in entries)
    streamed = []
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2, stream=True
    ):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    print(f"logprobs: {len(entries)} tokens, first {entries[0].token!r} {entries[0].logprob:.3f}, streamed alike")

    # Stop sequences: cut at the first occurrence, finish "stop".
    words = text.split()
    if len(words) >= 2:
        stop = words[1]
        cut = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stop=[stop])
        assert cut.choices[0].message.content == text[: text.index(stop)], (cut, stop)
        assert cut.choices[0].finish_reason == "stop"
        print(f"stop {stop!r}: {cut.choices[0].message.content!r}")

    # Seeds: the same seed samples the same text.
    story = [{"role": "user", "content": "Tell me a short story."}]
    a = client.chat.completions.create(model=model, messages=story, max_tokens=32, temperature=1.0, seed=1234)
    b = client.chat.completions.create(model=model, messages=story, max_tokens=32, temperature=1.0, seed=1234)
    assert a.choices[0].message.content == b.choices[0].message.content
    others = {
        client.chat.completions.create(model=model, messages=story, max_tokens=32, temperature=1.0, seed=s)
        .choices[0].message.content
        for s in (1, 2, 3)
    }
    assert others != {a.choices[0].message.content}, "three other seeds all gave the same text"
    print("seed: reproducible, and other seeds differ")

    two = client.chat.completions.create(model=model, messages=story, max_tokens=16, temperature=1.0, seed=5, n=2)
    assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices), two
    print("n=2: two choices")

    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text, done
    print(f"completion: {done.choices[0].text!r}")
    scored = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2
    )
    lps = scored.choices[0].logprobs
    assert scored.choices[0].text == done.choices[0].text and "".join(lps.tokens) == scored.choices[0].text
    assert len(lps.token_logprobs) == len(lps.tokens) and all(len(t) == 2 for t in lps.top_logprobs), lps
    assert [m.id for m in client.models.list().data] == [model]

    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        print(f"unknown model: 404 {e.body['message']!r}" if isinstance(e.body, dict) else f"unknown model: {e}")
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=10**7)
        raise AssertionError("max_tokens over the context was accepted")
    except openai.BadRequestError as e:
        print(f"max_tokens over the context: 400 ({e.code})")
    print("openai client: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
