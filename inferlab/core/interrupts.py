"""Ctrl-C and the engine's books: a KeyboardInterrupt is held back while the engine updates them.

One scheduling decision or one finished step changes several structures together (the queues,
each request's progress, the KV manager's reference counts, free blocks and block tables); an
interrupt between two of those changes would leave blocks leaked or requests in two queues. No
order of the changes makes every point between them consistent, and checking after the fact
would cost every step, so the engine defers the interrupt instead: during its calls in the main
thread (and while requests queued with add_request are pending) its own SIGINT handler stands in
front of the previous one, and a Ctrl-C that arrives inside a `DEFERRED` block is delivered when
the block ends. The forward pass and the wait for the device run inside `ALLOWED` blocks, where
Ctrl-C acts at once (they change no books). A second Ctrl-C while the first is held back is
delivered at once: a step that does not end (a hung tensor-parallel rank) can still be left. Only
the main thread receives signals, so elsewhere (an engine driven from a server's thread) these
blocks do nothing.
"""

import signal
import threading

MAIN_THREAD = threading.main_thread().ident


class _State:
    __slots__ = ("depth", "saved", "received", "previous")

    def __init__(self):
        self.depth = 0  # DEFERRED blocks open in the main thread (0 inside an ALLOWED block)
        self.saved: list[int] = []  # the depth each open ALLOWED block set aside
        self.received = None  # (signum, frame) of a Ctrl-C held back
        self.previous = None  # the handler ours stands in front of, while ours is installed


STATE = _State()


def _handler(signum, frame):
    if STATE.depth and STATE.received is None:
        STATE.received = (signum, frame)
        return
    STATE.received = None
    _deliver(signum, frame)


def _deliver(signum, frame) -> None:
    """Hands a Ctrl-C to the handler ours stands in front of (it raises KeyboardInterrupt, by default)."""
    (STATE.previous or signal.default_int_handler)(signum, frame)


def _deliver_received() -> None:
    signum, frame = STATE.received
    STATE.received = None
    _deliver(signum, frame)


def install() -> None:
    """Puts the engine's SIGINT handler in front of the current one (main thread only; not over
    SIG_IGN or SIG_DFL, which raise nothing to defer). Cheap when it is installed already."""
    if STATE.previous is not None or threading.get_ident() != MAIN_THREAD:
        return
    current = signal.getsignal(signal.SIGINT)
    if callable(current) and current is not _handler:
        STATE.previous = current
        signal.signal(signal.SIGINT, _handler)


def restore() -> None:
    """Puts the handler that install() replaced back, unless someone replaced ours since."""
    previous = STATE.previous
    if previous is None or threading.get_ident() != MAIN_THREAD:
        return
    if signal.getsignal(signal.SIGINT) is _handler:
        signal.signal(signal.SIGINT, previous)
    STATE.previous = None


class Installed:
    """install() for the length of a block, restore() after: one engine call."""

    __slots__ = ()

    def __enter__(self):
        install()

    def __exit__(self, *exc):
        restore()


# Entered every step: the names they use are bound as defaults, local lookups being the cheapest.


class Deferred:
    """Holds a Ctrl-C back until the outermost DEFERRED block ends, then raises it there."""

    __slots__ = ()

    def __enter__(self, get_ident=threading.get_ident, state=STATE):
        if get_ident() == MAIN_THREAD:
            state.depth += 1

    def __exit__(self, exc_type, exc, traceback, get_ident=threading.get_ident, state=STATE):
        if get_ident() == MAIN_THREAD:
            state.depth -= 1
            if not state.depth and state.received is not None:
                _deliver_received()


class Allowed:
    """Lets a Ctrl-C act at once inside a DEFERRED block, for work that changes no books (the
    forward pass, waiting for the device); one held back already is raised on entry."""

    __slots__ = ()

    def __enter__(self, get_ident=threading.get_ident, state=STATE):
        if get_ident() == MAIN_THREAD:
            if state.received is not None:
                _deliver_received()  # before changing anything: raising here skips __exit__
            state.saved.append(state.depth)
            state.depth = 0

    def __exit__(self, exc_type, exc, traceback, get_ident=threading.get_ident, state=STATE):
        if get_ident() == MAIN_THREAD:
            state.depth = state.saved.pop()


INSTALLED, DEFERRED, ALLOWED = Installed(), Deferred(), Allowed()


def held_back() -> bool:
    """Whether a Ctrl-C is waiting for the end of a DEFERRED block."""
    return STATE.received is not None
