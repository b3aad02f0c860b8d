#!/usr/bin/env bash
# Makes a Python environment with the official openai client (jsonschema, selenium) for the server
# tests and the load test; prints its python. Idempotent.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
env=${TURBOSPARK_PYENV:-$here/../../target/pyenv}
if ! "$env/bin/python" -c "import openai, jsonschema, rfc3339_validator, selenium" 2>/dev/null; then
    python3 -m venv "$env" >&2
    "$env/bin/pip" install -q -r "$here/requirements.txt" >&2
fi
echo "$env/bin/python"
