"""A multi-turn image conversation on the simulator: E calls and TTFT per turn, reuse on and off.

Each turn resends the conversation so far with its image in the first user
message (what chat clients do); the in-process simulated fleet (1E1P1D)
charges ``encode_item_s`` per encoded image.  Times are the simulator's model
time under Trio's autojump clock (deterministic), so the numbers show what E
costs per turn, not this machine's speed.

    PYTHONPATH=. python benchmarks/media_reuse.py [--turns 5] [--encode-s 0.05]
"""

from __future__ import annotations

import argparse

import trio
import trio.testing

from epd_actors.core.encoder_cache import EncoderCache, EncoderReuse
from epd_actors.core.supervisor import Supervisor
from epd_actors.protocol import ChatMessage, MediaItem, Prompt, SamplingParams
from epd_actors.request import DoneEvent, GenerationRequest
from epd_actors.testing import build_sim_fleet, sim_config


def turn(image: MediaItem, history: int) -> GenerationRequest:
    messages = [ChatMessage("user", (0, "what is this?"))]
    for n in range(history):
        messages += [ChatMessage("assistant", (f"answer {n}",)), ChatMessage("user", ("and?",))]
    return GenerationRequest(
        Prompt(messages=tuple(messages)),
        media=(image,),
        sampling=SamplingParams(max_tokens=8, temperature=0.0),
    )


async def conversation(turns: int, encode_s: float, reuse: bool) -> list[tuple[int, float]]:
    fleet = build_sim_fleet(
        {"encode": 1, "prefill": 1, "decode": 1},
        configs={"encode": sim_config(encode_item_s=encode_s)},
    )
    mode = "ttl" if reuse else "off"
    supervisor = Supervisor(
        fleet.pools, encoder_caches={"encode": EncoderCache(EncoderReuse(mode=mode))}
    )
    image = MediaItem.from_bytes(b"\x89PNG benchmark image" * 64, "image/png")
    rows = []
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        for history in range(turns):
            before = fleet.total("encode_requests")
            async with supervisor.generate(turn(image, history)) as events:
                last = [event async for event in events][-1]
            assert isinstance(last, DoneEvent), last
            rows.append((fleet.total("encode_requests") - before, last.timings.ttft_s or 0.0))
        nursery.cancel_scope.cancel()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--encode-s", type=float, default=0.05)
    args = parser.parse_args()
    results = {}
    for reuse in (False, True):
        results[reuse] = trio.run(
            conversation,
            args.turns,
            args.encode_s,
            reuse,
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
    print("| turn | E calls (off) | TTFT ms (off) | E calls (reuse) | TTFT ms (reuse) |")
    print("|---|---|---|---|---|")
    for n, ((calls_off, ttft_off), (calls_on, ttft_on)) in enumerate(
        zip(results[False], results[True], strict=True)
    ):
        print(
            f"| {n + 1} | {calls_off} | {ttft_off * 1000:.1f} | {calls_on} | {ttft_on * 1000:.1f} |"
        )


if __name__ == "__main__":
    main()
