"""PD: merged prefill and decode; consumes encoder outputs, streams the output."""

from __future__ import annotations

from ...protocol import Role
from .decode import DecodeActor
from .registry import register_stage


@register_stage
class PDActor(DecodeActor):
    """D without a KV hand-off: the same generate request, on a merged worker.

    In a plan without a prefill stage the context carries no
    ``kv_transfer_params``, so the inherited ``handle`` sends none.
    """

    stage = "pd"
    worker_roles = frozenset({Role.PD})
    consumes_kv_handoff = False  # a merged worker prefills for itself
    requires = ()
    default_policy = "cache_aware"  # it prefills: send a prompt where its prefix was sent
