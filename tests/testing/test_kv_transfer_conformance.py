"""The built-in KV transfers whose endpoints share a process pass the suite plugin authors run
(kv_transfer=distributed, one endpoint a process, is tested across processes in
tests/plugins/test_kv_transfer_distributed.py)."""

from inferlab.testing import KVTransferSuite


class TestLocal(KVTransferSuite):
    kv_transfer = "local"


class TestSimulated(KVTransferSuite):
    kv_transfer = "simulated"
    kv_transfer_options = {"link": "infiniband"}
    moves_data = False
    executor = "simulated"
    executor_options = {"profile": "roofline"}
