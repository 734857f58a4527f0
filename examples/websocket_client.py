"""Two generations over one WebSocket: cancel one, print the other.

Needs a router serving WebSocket (``ws_listen`` in the configuration file, see
docs/websocket.md).  The client starts a long and a short completion at once,
cancels the long one as soon as its first delta arrives, and prints the short
one's text, finish reason and token usage when it is done.

    python examples/websocket_client.py [URL] [--model NAME] [--api-key KEY]

URL defaults to ws://127.0.0.1:8001/v1/ws.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

import trio
from trio_websocket import open_websocket_url

DEFAULT_URL = "ws://127.0.0.1:8001/v1/ws"


def generate(client_id: str, model: str, prompt: str, max_tokens: int) -> str:
    """A ``generate`` message: the ``request`` is an ordinary /v1/completions body."""
    request = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return json.dumps(
        {"type": "generate", "id": client_id, "kind": "completion", "request": request}
    )


async def main(
    url: str = DEFAULT_URL, *, model: str = "sim-model", api_key: str | None = None
) -> None:
    """Run both generations on one connection; return once each has ended."""
    headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else None
    async with open_websocket_url(url, extra_headers=headers) as ws:
        await ws.send_message(generate("long", model, "Tell me a long story.", 4096))
        await ws.send_message(generate("short", model, "Say something short.", 24))
        running = {"long", "short"}
        texts: dict[str, list[str]] = {"long": [], "short": []}
        while running:
            message: dict[str, Any] = json.loads(await ws.get_message())
            kind, client_id = message["type"], message["id"]
            if kind == "delta":
                texts[client_id].append(message["text"])
                if client_id == "long" and len(texts["long"]) == 1:
                    await ws.send_message(json.dumps({"type": "cancel", "id": "long"}))
            elif kind == "done":
                usage = message["usage"]
                print(f"[{client_id}] {''.join(texts[client_id])}")
                print(
                    f"[{client_id}] finish_reason={message['finish_reason']} "
                    f"prompt_tokens={usage['prompt_tokens']} "
                    f"completion_tokens={usage['completion_tokens']} "
                    f"total_tokens={usage['total_tokens']}"
                )
            elif kind == "cancelled":
                print(f"[{client_id}] cancelled after {len(texts[client_id])} deltas")
            elif kind == "error":
                error = message["error"]
                print(f"[{client_id}] error {error['type']}/{error['code']}: {error['message']}")
            if kind in ("done", "cancelled", "error"):
                running.discard(client_id)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default=DEFAULT_URL)
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    trio.run(partial(main, args.url, model=args.model, api_key=args.api_key))
