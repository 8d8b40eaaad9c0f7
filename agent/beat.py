"""A worker's heartbeat, as its own small process: ``python -m agent.beat ENDPOINT NODE DEVICE PID``.

The worker's main thread runs torch, whose blocking calls (a rendezvous, a collective waiting for a
slow peer) may hold the GIL for seconds on a loaded machine; a beat thread in the same process then
falls silent and the driver would take a busy worker for a dead one. This process beats for worker
PID every ``BEAT_S`` while PID lives, and exits when it does not (so the beats stop within a beat of
the worker's death, however it died). The hub may answer ``stop``: the worker is killed (SIGKILL) and
the beats end; that is how a worker stuck in a collective with a dead peer is let go. CURVE keys (server, public, secret; z85, one a line) come on
stdin, never in argv or the environment. Imports only zmq.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys

import zmq

BEAT_S = 0.5
STOP = b"stop"  # from the driver's hub: stop the worker (it is stuck)


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
            if sock.poll(int(BEAT_S * 1000)) and sock.recv_multipart()[0] == STOP:
                # the driver gave up on the worker: stuck in a collective whose peer died (a blocked C++
                # call cannot be interrupted from inside); its agent restarts it with nothing held
                os.kill(pid, signal.SIGKILL)
                break
    finally:
        sock.close(linger=0)
        ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
