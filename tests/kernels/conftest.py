"""Without a GPU, test_kernels_compile.py re-runs the kernel tests of two files (all but the
generate ones, the slow ones too) in Triton's interpreter, and fails if any of them fails: in a
session that runs it, their slow tests run there alone, not a second time in this process."""

import pytest
import torch

COMPILE_TEST = "tests/kernels/test_kernels_compile.py::test_every_kernel_variant_the_cpu_tests_reach_compiles_for_sm90"
RECORDED_FILES = ("tests/plugins/test_triton_attention.py", "tests/kernels/test_model_kernels.py")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or COMPILE_TEST not in {item.nodeid for item in items}:
        return
    rerun = [
        item
        for item in items
        if item.nodeid.split("::")[0] in RECORDED_FILES
        and item.get_closest_marker("slow")
        and not any("generate" in keyword.lower() for keyword in item.keywords)  # as its -k "not generate"
    ]
    if rerun:
        config.hook.pytest_deselected(items=rerun)
        items[:] = [item for item in items if item not in set(rerun)]
