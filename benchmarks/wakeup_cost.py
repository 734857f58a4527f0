"""What one wake-up from idle costs on this machine, apart from the router.

A sender thread writes one byte to a socketpair every ``--gaps`` seconds; the
receiver reads them, either with a plain blocking ``recv`` or as a Trio task
(``SocketStream.receive_some``).  The receiver thread's CPU time comes from
``/proc/thread-self/schedstat`` (nanoseconds on the CPU, not tick-sampled), and
is reported per message.  With no gap the receiver rarely sleeps; with a gap
of milliseconds it sleeps before every message, and the difference is what a
wake-up costs (cold caches and TLB, and on a VM the virtual CPU's halt).

    python benchmarks/wakeup_cost.py                    # gaps 0, 1 ms, 10 ms
    python benchmarks/wakeup_cost.py --messages 200 --gaps 0,0.01
"""

from __future__ import annotations

import argparse
import socket
import threading
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Callable


def runtime_ns() -> int:
    """Nanoseconds the calling thread has run so far."""
    with open("/proc/thread-self/schedstat", encoding="ascii") as handle:
        return int(handle.read().split()[0])


def receive_plain(sock: socket.socket, count: int) -> None:
    received = 0
    while received < count:
        received += len(sock.recv(4096))


def receive_trio(sock: socket.socket, count: int) -> None:
    async def main() -> None:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        received = 0
        while received < count:
            received += len(await stream.receive_some(4096))

    trio.run(main)


def measure(receive: Callable[[socket.socket, int], None], count: int, gap_s: float) -> float:
    """Microseconds of the receiver's CPU per message."""
    sender_end, receiver_end = socket.socketpair()

    never_set = threading.Event()

    def send() -> None:
        for _ in range(count):
            if gap_s:
                never_set.wait(gap_s)  # a plain sleep of gap_s, in this thread
            sender_end.send(b"x")

    sender = threading.Thread(target=send)
    started = runtime_ns()
    sender.start()
    receive(receiver_end, count)
    used = runtime_ns() - started
    sender.join()
    sender_end.close()
    receiver_end.close()
    return used / count / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--gaps", default="0,0.001,0.01", help="seconds, comma-separated")
    args = parser.parse_args()
    gaps = [float(gap) for gap in args.gaps.split(",") if gap]
    print("| receiver | " + " | ".join(f"gap {gap * 1000:g} ms" for gap in gaps) + " |")
    print("|---|" + "---:|" * len(gaps))
    for name, receive in (("plain recv", receive_plain), ("Trio task", receive_trio)):
        cells = [f"{measure(receive, args.messages, gap):.0f} µs" for gap in gaps]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
