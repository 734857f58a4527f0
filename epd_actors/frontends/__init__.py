"""Front ends: the ways clients reach a router.

* :mod:`.http` -- the OpenAI-compatible HTTP/1.1 + SSE server (h11 over Trio).
* :mod:`.ws` -- the WebSocket streaming front end.
* :mod:`.admin` -- the admin API (workers added, drained and removed at run time).

They parse and format requests with the sans-IO :mod:`epd_actors.openai` package and hand one
request object to :class:`~epd_actors.core.router.Router`.
"""
