"""Greedy continuations by llama.cpp (its Python bindings, llama-cpp-python
0.3.36), the reference the engine's greedy output is compared with.

usage: python greedy.py MODELS_DIR OUT.json

For each real model and prompt: the prompt's ids (BOS per the model, special
tokens not parsed), the 64 ids llama.cpp picks greedily, and at each step the
margin between its top two logits. The KV cache is
f32 and flash attention off, so both engines keep attention in float32 and
what differs is only summation order.
"""
import json
import sys

import llama_cpp
from llama_cpp import Llama

MODELS = [
    "smollm2-135m-instruct-q4_1.gguf",
    "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "Q: What is the boiling point of water at sea level?\nA:",
]
N = 64


def main():
    models_dir, out_path = sys.argv[1], sys.argv[2]
    out = {"llama_cpp_python": llama_cpp.__version__, "n_predict": N, "runs": []}
    for name in MODELS:
        llm = Llama(
            model_path=f"{models_dir}/{name}",
            n_ctx=512,
            n_batch=512,
            n_threads=2,
            flash_attn=False,
            type_k=0,  # GGML_TYPE_F32
            type_v=0,
            logits_all=True,
            verbose=False,
        )
        for prompt in PROMPTS:
            ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
            llm.reset()
            llm.eval(ids)
            generated, margins = [], []
            for _ in range(N):
                logits = llm.scores[llm.n_tokens - 1]
                top2 = logits.argsort()[-2:]
                tok = int(top2[1])
                margins.append(round(float(logits[top2[1]] - logits[top2[0]]), 5))
                if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                    break
                generated.append(tok)
                llm.eval([tok])
            out["runs"].append({"model": name, "prompt": prompt, "prompt_ids": ids, "generated": generated,
                                "margins": margins})
            print(name, repr(prompt[:30]), len(generated), file=sys.stderr)
        del llm
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
