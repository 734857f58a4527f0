"""The router core: the supervisor and its actors, pools, routing policies, health, retries,
lifecycle, the output relay, metrics and the router configuration.

Nothing here does network I/O of its own: it reaches workers through the backends it is given
(:mod:`epd_actors.backends`) and is reached by the front ends (:mod:`epd_actors.frontends`)
through :class:`~epd_actors.core.router.Router`.
"""
