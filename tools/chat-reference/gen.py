"""Reference renderings of chat templates for ts-engine's chat tests.

Renders every template listed in crates/ts-engine/tests/data/chat/templates.json
on every conversation in conversations.json with Python's jinja2, set up the
way Hugging Face transformers' apply_chat_template sets it up (see README.md),
and writes expected/<template>.json.

Importing templates (each adds entries to templates.json):
    --extract MODEL.gguf NAME        a GGUF's tokenizer.chat_template (needs `gguf`)
    --import-llama-cpp DIR           llama.cpp's models/templates/*.jinja
    --import-llama-cpp-tests FILE    the templates in llama.cpp's tests/test-chat-template.cpp
    --import-file PATH NAME SOURCE   any other template file

Templates that render none of the conversations in jinja2 (tool-only
templates) are reported and left out.
"""

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "crates/ts-engine/tests/data/chat"
MANIFEST = DATA / "templates.json"
JINJA2_VERSION = "3.1.6"

# bos/eos token text by template family (first matching prefix wins), for
# templates whose source does not say; the renderings only need the usual text.
FAMILY_TOKENS = [
    ("smollm2", "<|im_start|>", "<|im_end|>"),
    ("HuggingFaceTB", "<|im_start|>", "<|im_end|>"),
    ("qwen", "<|endoftext|>", "<|im_end|>"),
    ("Qwen", "<|endoftext|>", "<|im_end|>"),
    ("meta-llama", "<|begin_of_text|>", "<|eot_id|>"),
    ("NousResearch", "<|begin_of_text|>", "<|im_end|>"),
    ("fireworks", "<|begin_of_text|>", "<|eot_id|>"),
    ("meetkai", "<|begin_of_text|>", "<|eot_id|>"),
    ("deepseek", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("llama-cpp-deepseek", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("google-gemma", "<bos>", "<eos>"),
    ("openai-gpt-oss", "<|startoftext|>", "<|return|>"),
    ("microsoft-Phi", "<s>", "<|endoftext|>"),
]


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant
    text with it (for its assistant-token mask) and renders the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class RaisedByTemplate(jinja2.exceptions.TemplateError):
    """What the template's own `raise_exception(message)` raises."""


def make_environment(now):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise RaisedByTemplate(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: now.strftime(fmt)
    return env


def family_tokens(name):
    for prefix, bos, eos in FAMILY_TOKENS:
        if name.startswith(prefix):
            return bos, eos
    return "<s>", "</s>"


def message_content(message):
    content = message["content"]
    if isinstance(content, list):
        # Text parts joined by a newline, as llama.cpp's server joins them.
        return "\n".join(part["text"] for part in content if part.get("type") == "text")
    return content


def render_case(template, case, bos, eos):
    # Tool calls, tool results' ids and names, and reasoning pass as given
    # (arguments as objects, as transformers takes them).
    messages = [{**m, "content": message_content(m)} for m in case["messages"]]
    try:
        text = template.render(
            messages=messages,
            tools=case.get("tools"),
            documents=None,
            add_generation_prompt=case["add_generation_prompt"],
            bos_token=bos,
            eos_token=eos,
            **case.get("kwargs", {}),
        )
    except RaisedByTemplate as e:
        return {"error": str(e), "raised_by_template": True}
    except Exception as e:  # noqa: BLE001 - any failure is a reference outcome
        return {"error": f"{type(e).__name__}: {e}", "raised_by_template": False}
    return {"text": text}


def load_manifest():
    if MANIFEST.exists():
        return json.loads(MANIFEST.read_text(encoding="utf-8"))
    return {}


def add_template(manifest, name, source_text, source, bos=None, eos=None):
    if bos is None:
        bos, eos = family_tokens(name)
    path = DATA / "templates" / f"{name}.jinja"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(source_text.encode("utf-8"))
    manifest[name] = {"file": path.name, "source": source, "bos_token": bos, "eos_token": eos}


def extract_gguf(manifest, gguf_path, name):
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    field = reader.fields.get("tokenizer.chat_template")
    if field is None:
        print(f"{gguf_path}: no tokenizer.chat_template", file=sys.stderr)
        return
    text = bytes(field.parts[field.data[0]]).decode("utf-8")
    add_template(manifest, name, text, f"tokenizer.chat_template of {Path(gguf_path).name}")


CPP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'"}


def cpp_string(literal):
    return re.sub(r"\\(.)", lambda m: CPP_ESCAPES[m.group(1)], literal)


def test_template_name(title):
    """"mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1' template ...)" -> "test-mistralai-Mistral-7B-Instruct-v0.2-v1"."""
    model, _, note = title.partition(" (")
    name = "test-" + re.sub(r"[^A-Za-z0-9.]+", "-", model).strip("-")
    if note:
        tag = re.search(r"'([^']+)'", note) or re.search(r"pre-v\d", note)
        name += "-" + (tag.group(1) if tag and tag.groups() else tag.group(0) if tag else re.sub(r"[^A-Za-z0-9]+", "-", note).strip("-"))
    return name


def import_llama_cpp_tests(manifest, cpp_path):
    text = Path(cpp_path).read_text(encoding="utf-8")
    literal = r'(?:u8)?"((?:[^"\\]|\\.)*)"'
    entry = re.compile(
        r"/\* \.name= \*/ " + literal + r",\s*/\* \.template_str= \*/ " + literal + r",(.*?)\n        \}",
        re.S,
    )
    for m in entry.finditer(text):
        title = cpp_string(m.group(1))
        name = test_template_name(title)
        rest = m.group(3)
        bos = re.search(r"/\* \.bos_token= \*/ " + literal, rest)
        eos = re.search(r"/\* \.eos_token= \*/ " + literal, rest)
        add_template(
            manifest,
            name,
            cpp_string(m.group(2)),
            f"llama.cpp tests/test-chat-template.cpp, case \"{title}\"",
            cpp_string(bos.group(1)) if bos else "",
            cpp_string(eos.group(1)) if eos else "",
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--extract", nargs=2, action="append", metavar=("GGUF", "NAME"), default=[])
    parser.add_argument("--import-llama-cpp", metavar="DIR")
    parser.add_argument("--import-llama-cpp-tests", metavar="FILE")
    parser.add_argument("--import-file", nargs=3, action="append", metavar=("PATH", "NAME", "SOURCE"), default=[])
    args = parser.parse_args()
    if jinja2.__version__ != JINJA2_VERSION:
        sys.exit(f"jinja2 {jinja2.__version__} found, the references are made with {JINJA2_VERSION}")

    manifest = load_manifest()
    for gguf_path, name in args.extract:
        extract_gguf(manifest, gguf_path, name)
    if args.import_llama_cpp:
        for path in sorted(Path(args.import_llama_cpp).glob("*.jinja")):
            text = path.read_bytes().decode("utf-8")
            add_template(manifest, path.stem, text, f"llama.cpp models/templates/{path.name}")
    if args.import_llama_cpp_tests:
        import_llama_cpp_tests(manifest, args.import_llama_cpp_tests)
    for path, name, source in args.import_file:
        add_template(manifest, name, Path(path).read_bytes().decode("utf-8"), source)

    conversations = json.loads((DATA / "conversations.json").read_text(encoding="utf-8"))
    env = make_environment(datetime.fromisoformat(conversations["now"]))
    out_dir = DATA / "expected"
    out_dir.mkdir(exist_ok=True)
    for old in out_dir.glob("*.json"):
        old.unlink()

    for name in sorted(manifest):
        entry = manifest[name]
        path = DATA / "templates" / entry["file"]
        source = path.read_bytes().decode("utf-8")
        try:
            template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            print(f"{name}: left out, does not compile in jinja2: {e}", file=sys.stderr)
            path.unlink()
            del manifest[name]
            continue
        cases = {case["name"]: render_case(template, case, entry["bos_token"], entry["eos_token"]) for case in conversations["cases"]}
        n_ok = sum("text" in c for c in cases.values())
        if n_ok == 0:
            first_error = next(iter(cases.values()))["error"]
            print(f"{name}: left out, renders no conversation without tools ({first_error})", file=sys.stderr)
            path.unlink()
            del manifest[name]
            continue
        print(f"{name}: {n_ok}/{len(cases)} cases render")
        with open(out_dir / f"{name}.json", "w", encoding="utf-8", newline="\n") as f:
            json.dump({"template": entry["file"], "cases": cases}, f, ensure_ascii=False, indent=1)
            f.write("\n")

    with open(MANIFEST, "w", encoding="utf-8", newline="\n") as f:
        json.dump(dict(sorted(manifest.items())), f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
