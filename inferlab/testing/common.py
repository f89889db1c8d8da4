"""What the conformance suites share."""

from collections import Counter

from hypothesis.stateful import run_state_machine_as_test


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def run_machine(machine: type, hypothesis_settings, **attributes) -> Counter:
    """Runs a state machine with these class attributes set (the plugin under test); returns what
    its `seen` counter recorded across examples, proof that the interesting paths were taken."""
    configured = type(machine.__name__, (machine,), {**attributes, "seen": Counter()})
    run_state_machine_as_test(configured, settings=hypothesis_settings)
    return configured.seen
