"""A worker's heartbeat, as its own small process: ``python -m agent.beat ENDPOINT NODE DEVICE PID``.

The worker's main thread runs torch, whose blocking calls (a rendezvous, a collective waiting for a
slow peer) may hold the GIL for seconds on a loaded machine; a beat thread in the same process then
falls silent and the driver would take a busy worker for a dead one. This process beats for worker
PID every ``BEAT_S`` while PID lives, and exits when it does not (so the beats stop within a beat of
the worker's death, however it died). CURVE keys (server, public, secret; z85, one a line) come on
stdin, never in argv or the environment. Imports only zmq.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import zmq

BEAT_S = 0.5


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid  # reparented: the worker is gone even if its pid was reused


def main(argv: list[str]) -> int:
    endpoint, node, device, pid = argv[0], argv[1], int(argv[2]), int(argv[3])
    keys = [line.strip().encode() for line in sys.stdin.read().splitlines() if line.strip()]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if len(keys) == 3:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(endpoint)
    body = pickle.dumps((node, device, pid))
    try:
        while _alive(pid):
            sock.send_multipart([b"beat", body])
            time.sleep(BEAT_S)  # the beat's period (a zmq poll with no sockets would not wait)
    finally:
        sock.close(linger=0)
        ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
