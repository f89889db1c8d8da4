"""Simulated execution: the real scheduler policy, KV manager and engine loop, with the device's
work replaced by a step-cost model on a virtual clock (`executor=simulated`)."""
