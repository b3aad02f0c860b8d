"""Structured output through the official openai client: twenty json_schema
requests (required fields, enums, bounded arrays and integers, nested objects,
patterns, formats, anyOf, $ref, nullable fields), every fifth streamed; each
reply must parse and validate under Python's jsonschema (formats checked).
Then client.chat.completions.parse with a pydantic model, and a schema the
server cannot enforce, refused with 400 naming the field.
Usage: openai_json_schema_e2e.py BASE_URL MODEL_ID"""

import json
import sys
from typing import Annotated

import jsonschema
import openai
import pydantic


def obj(properties, required=None):
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def text(n):
    return {"type": "string", "minLength": 1, "maxLength": n}


POINT = obj({"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}})

CASES = [
    ("Describe a person as JSON.", obj({"name": text(30), "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Pick a color.", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("List a few fruits.", obj({"fruits": {"type": "array", "items": text(15), "minItems": 2, "maxItems": 4}})),
    ("Give an address in Paris.", obj({"address": obj({
        "street": text(30), "city": text(20), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("Grade an essay.", obj({"score": {"type": "integer", "minimum": 1, "maximum": 10}, "passed": {"type": "boolean"}})),
    ("Invent a product code.", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}})),
    ("When is the next holiday?", obj({"event": text(30), "date": {"type": "string", "format": "date"}})),
    ("Give a support contact.", obj({"email": {"type": "string", "format": "email"}})),
    ("Give a value.", obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, text(10)]}})),
    ("Make a shopping list.", obj({"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
        "name": text(15), "qty": {"type": "integer", "minimum": 1, "maximum": 5}})}})),
    ("What is the temperature outside?", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 50}})),
    ("Report the API status.", obj({"version": {"const": "1.0"}, "ok": {"type": "boolean"}})),
    ("Give a person's middle name, if any.", obj({"first": text(15), "middle": {"type": ["string", "null"], "maxLength": 15}})),
    ("Give an identifier for a new record.", obj({"id": {"type": "string", "format": "uuid"}})),
    ("Write a 2x2 matrix of digits.", obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}})),
    ("Give a line segment.", {"$defs": {"point": POINT}, **obj({"start": {"$ref": "#/$defs/point"},
                                                                "end": {"$ref": "#/$defs/point"}})}),
    ("How urgent is a broken printer?", obj({"priority": {"enum": [1, 2, 3]}, "reason": text(40)})),
    ("When did the meeting start?", obj({"started": {"type": "string", "format": "date-time"}})),
    ("Title a blog post.", obj({"title": text(40), "subtitle": text(40)}, required=["title"])),
    ("Is the sky blue?", obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
]


def reply(client, model, question, schema, stream):
    """The reply's text and finish reason."""
    args = dict(model=model, messages=[{"role": "user", "content": question + " Answer in JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
                temperature=0, max_tokens=120)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    return content, finish


class Book(pydantic.BaseModel):
    """Bounded, so that a small model's reply ends within max_tokens."""
    title: str = pydantic.Field(max_length=60)
    year: int = pydantic.Field(ge=1000, le=2100)
    genres: list[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(min_length=1, max_length=3)


def main():
    base, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base, api_key="none", timeout=300)
    checker = jsonschema.FormatChecker()
    for i, (question, schema) in enumerate(CASES):
        jsonschema.Draft202012Validator.check_schema(schema)
        stream = i % 5 == 4
        content, finish = reply(client, model, question, schema, stream)
        print(f"{i:2} {'stream' if stream else 'whole '} {content}")
        assert finish == "stop", (question, finish, content)
        jsonschema.validate(json.loads(content), schema, format_checker=checker)

    parsed = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a famous novel."}],
        response_format=Book, temperature=0, max_tokens=120)
    book = parsed.choices[0].message.parsed
    print("parse:", book)
    assert isinstance(book, Book) and book.title, parsed

    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}})
        raise AssertionError("an invalid schema was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format.json_schema.schema", e.body
        print("refused:", e.body["message"])
    print(f"{len(CASES)} schemas validated")


if __name__ == "__main__":
    main()
