"""A fake Kubernetes API server for EndpointSlices: list, watch, bookmarks, 410 Gone.

It speaks the parts of the real protocol a discovery uses, over HTTP/1.1 (the
package's server shell, ``epd_actors.http.server``) on a loopback port,
optionally behind TLS:

- ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=k=v,...``
  answers an ``EndpointSliceList`` whose ``metadata.resourceVersion`` is the
  current version;
- the same with ``watch=true&resourceVersion=RV`` streams (chunked) one JSON
  event per line: every change after ``RV`` from the history, then each new
  one as it happens (``ADDED``/``MODIFIED``/``DELETED`` and, when the client
  sent ``allowWatchBookmarks=true``, ``BOOKMARK``); ``timeoutSeconds`` is
  honoured;
- a watch from a version older than the compacted floor answers ``410 Gone``:
  as a ``200`` stream with one ``ERROR`` event carrying the ``Status`` (what a
  real API server does), or, with ``gone_as_http``, as an HTTP 410;
- every request must carry ``Authorization: Bearer TOKEN``; otherwise 401.

The test drives it: ``put`` (add or change a slice), ``delete``, ``bookmark``,
``compact``, ``end_watches`` (the server's watch timeout), ``go_away`` and
``come_back`` (on the same port).  ``requests`` records each request's path
and query.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import trio

from epd_actors.http.server import HttpResponse, HttpServer

if TYPE_CHECKING:
    import ssl

    from epd_actors.http.server import HttpRequest, Responder

PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"


@dataclass
class Seen:
    path: str
    query: dict[str, str]
    authorization: str | None

    @property
    def watch(self) -> bool:
        return self.query.get("watch") == "true"


@dataclass
class _Watcher:
    namespace: str
    selector: dict[str, str]
    bookmarks: bool
    send: trio.MemorySendChannel[dict[str, Any] | None]


@dataclass
class FakeApiServer:
    token: str = "s3cret"
    gone_as_http: bool = False
    ssl_context: ssl.SSLContext | None = None
    port: int = 0
    version: int = 100
    floor: int = 0
    slices: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    requests: list[Seen] = field(default_factory=list)
    watchers: list[_Watcher] = field(default_factory=list)
    _scope: trio.CancelScope | None = None
    _nursery: trio.Nursery | None = None
    changed: trio.Event = field(default_factory=trio.Event)

    # --- the test's controls ---------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        await nursery.start(self._serve)

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def put(self, namespace: str, obj: dict[str, Any]) -> None:
        """Create or replace a slice (ADDED or MODIFIED)."""
        key = (namespace, obj["metadata"]["name"])
        kind = "MODIFIED" if key in self.slices else "ADDED"
        self.version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"]["namespace"] = namespace
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.slices[key] = stored
        self._publish(kind, stored)

    def delete(self, namespace: str, name: str) -> None:
        stored = self.slices.pop((namespace, name))
        self.version += 1
        gone = copy.deepcopy(stored)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self._publish("DELETED", gone)

    def bookmark(self) -> int:
        """Send a BOOKMARK at a new version to every watcher that asked for them."""
        self.version += 1
        obj = {
            "kind": "EndpointSlice",
            "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.version), "creationTimestamp": None},
            "addressType": "",
            "endpoints": None,
        }
        for watcher in list(self.watchers):
            if watcher.bookmarks:
                watcher.send.send_nowait({"type": "BOOKMARK", "object": obj})
        return self.version

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410."""
        self.version += 1
        self.floor = self.version
        self.history.clear()

    def end_watches(self) -> None:
        """End every open watch, as the server's timeoutSeconds does."""
        for watcher in list(self.watchers):
            watcher.send.send_nowait(None)

    def go_away(self) -> None:
        """Close the listener and every connection."""
        assert self._scope is not None
        self._scope.cancel()
        self._scope = None
        self.watchers.clear()

    async def come_back(self) -> None:
        assert self._nursery is not None
        assert self._scope is None
        await self._nursery.start(self._serve)

    async def wait_for_request(self, predicate: Any) -> Seen:
        while True:
            for seen in self.requests:
                if predicate(seen):
                    return seen
            await self._changed()

    async def _changed(self) -> None:
        await self.changed.wait()

    def _note(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    # --- the server -------------------------------------------------------

    def _publish(self, kind: str, obj: dict[str, Any]) -> None:
        self.history.append((self.version, kind, obj))
        namespace = obj["metadata"]["namespace"]
        for watcher in list(self.watchers):
            if watcher.namespace == namespace and _matches(obj, watcher.selector):
                watcher.send.send_nowait({"type": kind, "object": obj})

    async def _serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.CancelScope() as scope:
            self._scope = scope
            listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
            self.port = listeners[0].socket.getsockname()[1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._connection, listeners)
                task_status.started()

    async def _connection(self, stream: trio.abc.Stream) -> None:
        if self.ssl_context is not None:
            stream = trio.SSLStream(stream, self.ssl_context, server_side=True)
        await HttpServer(self._answer, name="fake-kubernetes").handle_connection(stream)

    async def _answer(self, request: HttpRequest, responder: Responder) -> HttpResponse | None:
        target = urlsplit(request.target)
        query = {k: v[-1] for k, v in parse_qs(target.query).items()}
        seen = Seen(target.path, query, request.header("authorization"))
        self.requests.append(seen)
        self._note()
        if seen.authorization != f"Bearer {self.token}":
            return _json(401, _status(401, "Unauthorized", "Unauthorized"))
        parts = target.path[len(PREFIX) :].split("/") if target.path.startswith(PREFIX) else []
        if len(parts) != 2 or parts[1] != "endpointslices":
            return _json(404, _status(404, "NotFound", "no such path"))
        namespace = parts[0]
        selector = _selector(query.get("labelSelector", ""))
        if seen.watch:
            return await self._watch(responder, namespace, selector, query)
        items = [
            obj
            for (ns, _), obj in sorted(self.slices.items())
            if ns == namespace and _matches(obj, selector)
        ]
        body = {
            "kind": "EndpointSliceList",
            "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.version)},
            "items": items,
        }
        return _json(200, body)

    async def _watch(
        self,
        responder: Responder,
        namespace: str,
        selector: dict[str, str],
        query: dict[str, str],
    ) -> HttpResponse | None:
        since = int(query.get("resourceVersion") or self.version)
        if since < self.floor:
            gone = _status(410, "Expired", f"too old resource version: {since} ({self.floor})")
            if self.gone_as_http:
                return _json(410, gone)
            await responder.start(200, _STREAM_HEAD)
            await responder.send(_line({"type": "ERROR", "object": gone}))
            await responder.end()
            return None
        send, receive = trio.open_memory_channel[dict[str, Any] | None](1000)
        watcher = _Watcher(namespace, selector, query.get("allowWatchBookmarks") == "true", send)
        for version, kind, obj in self.history:
            if (
                version > since
                and obj["metadata"]["namespace"] == namespace
                and _matches(obj, selector)
            ):
                send.send_nowait({"type": kind, "object": obj})
        self.watchers.append(watcher)
        timeout = float(query.get("timeoutSeconds") or 3600)
        try:
            await responder.start(200, _STREAM_HEAD)
            with trio.move_on_after(timeout):
                async for event in receive:
                    if event is None:
                        break
                    await responder.send(_line(event))
            await responder.end()
        finally:
            if watcher in self.watchers:
                self.watchers.remove(watcher)
        return None


def endpoint_slice(
    name: str,
    endpoints: list[dict[str, Any]],
    *,
    labels: dict[str, str],
    port: int = 8000,
    port_name: str = "http",
) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "labels": dict(labels)},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def endpoint(
    pod: str,
    ip: str,
    *,
    uid: str | None = None,
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
) -> dict[str, Any]:
    return {
        "addresses": [ip],
        "conditions": {
            "ready": ready,
            "serving": ready if serving is None else serving,
            "terminating": terminating,
        },
        "targetRef": {"kind": "Pod", "name": pod, "uid": uid or f"uid-{pod}"},
    }


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _selector(text: str) -> dict[str, str]:
    out = {}
    for term in filter(None, text.split(",")):
        key, _, value = term.partition("=")
        out[key] = value.lstrip("=")
    return out


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


_STREAM_HEAD = [("content-type", "application/json")]  # chunked: the shell frames it


def _json(status: int, body: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(body).encode(), "application/json")


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"
