"""Experiments on an engine or a server: workloads and traces, the in-process driver and the HTTP
client, run records, latency figures, timeline, floor, the bench and profile jobs, and the report.
Imports run one way: config (inferlab.conf) -> workload -> driver/client -> records -> figures -> report."""
