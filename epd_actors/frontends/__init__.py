"""Front ends: the ways clients reach a router.

* :mod:`.openai_schema` -- pure, synchronous parsing and validation of OpenAI
  request bodies into :class:`~epd_actors.request.GenerationRequest`, and the
  response, SSE and error formats (shared by every network front end).
* :mod:`.media` -- media items from ``data:`` URLs, and the allow-list and
  bounded fetching of remote or local media.
* :mod:`.http` -- the OpenAI-compatible HTTP/1.1 + SSE server (h11 over Trio).
"""
