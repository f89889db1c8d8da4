"""Session affinity: the requests of one session (metadata["session"]) go to the replica that
served its first request, where its conversation's prefix is cached; a new session, or one whose
replica is gone, goes to the replica with the fewest outstanding tokens. Requests without a
session are routed by load alone. `max_sessions` bounds the record, forgetting the oldest."""

from collections import OrderedDict
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl


@dataclass
class SessionOptions:
    max_sessions: int = 100_000  # `inferlab router=session_affinity router.max_sessions=...`


class SessionAffinity:
    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self.home: OrderedDict = OrderedDict()  # session -> replica_id, oldest first

    def route(self, request, replicas, state):
        session = request.metadata.get("session")
        pinned = next((r for r in replicas if r.replica_id == self.home.get(session)), None)
        choice = pinned or min(replicas, key=lambda r: (r.num_outstanding_tokens, r.replica_id))
        if session is not None:
            self.home[session] = choice.replica_id
            self.home.move_to_end(session)
            if len(self.home) > self.max_sessions:
                self.home.popitem(last=False)
        return choice


@hookimpl
def register_routers(register):
    register("session_affinity", SessionAffinity, options=SessionOptions)
