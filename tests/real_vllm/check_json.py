"""Validate one JSON value against a JSON schema with ``jsonschema``, in the lane's virtualenv.

    echo '{"instance": ..., "schema": ...}' | python tests/real_vllm/check_json.py

Prints a JSON array of error messages (empty: valid).  Exit status 3 when this
Python has no ``jsonschema`` (vLLM depends on it, so the lane's virtualenv has
it; the project's own does not), 2 when the input is not such an object.
"""

from __future__ import annotations

import json
import sys

MISSING_JSONSCHEMA = 3


def main() -> int:
    try:
        import jsonschema
    except ImportError as exc:
        print(f"jsonschema is not installed: {exc}", file=sys.stderr)
        return MISSING_JSONSCHEMA
    try:
        given = json.load(sys.stdin)
        instance, schema = given["instance"], given["schema"]
    except (ValueError, KeyError, TypeError) as exc:
        print(f"expected {{'instance': ..., 'schema': ...}} on stdin: {exc!r}", file=sys.stderr)
        return 2
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(instance)]
    print(json.dumps(errors))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
