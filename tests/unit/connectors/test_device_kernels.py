"""The connectors' device kernels (Triton) compile for the Hopper cards the GPU runs use
(sm_90), with the argument types their launches pass, on a machine without a GPU: a kernel
that no longer compiles (a wrong type, an argument added on one side only) fails here, not
on the first minutes of a GPU machine. What they do on a GPU is proven by the GPU oracles."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm.distributed.afd import ipc_kernels as ipc
from vllm.distributed.afd import nixl_device as nd

HOPPER = GPUTarget("cuda", 90, 32)
P = "*i64"  # counters, flags, records, error words, pointer tables: int64 words
DATA = "*bf16"  # activations
BLOCK = {"BLOCK": 1024}

# (kernel, its arguments' types as its launch passes them, its constexprs)
KERNELS = {
    "nixl copy to slot": (nd._copy_to_slot_kernel,
                          {"src": DATA, "base": DATA, "ctr": P, "slot_elems": "i32", "n": "i32"},
                          BLOCK),
    "nixl ring": (nd._ring_kernel, {"ctr": P, "records": P, "nbytes": "i32"}, {}),
    "nixl control": (nd._control_kernel, {"ctr": P, "records": P, "tokens": "i32",
                                          "flags": "i32"}, {}),
    "nixl wait": (nd._wait_kernel, {"ctr": P, "flag": P, "err": P, "waited": P,
                                    "timeout_ns": "i64"}, {}),
    "nixl copy from slot": (nd._copy_from_slot_kernel,
                            {"base": DATA, "out": DATA, "ctr": P, "slot_elems": "i32",
                             "n": "i32"}, BLOCK),
    "cuda_ipc signal": (ipc._signal_kernel, {"ctr_ptr": P, "flag_ptr": P}, {}),
    "cuda_ipc control": (ipc._control_kernel, {"ctr_ptr": P, "row_ptr": P, "num_tokens": "i32",
                                               "flags": "i32", "ub1_tokens": "i32"}, {}),
    "cuda_ipc wait": (ipc._wait_kernel, {"ctr_ptr": P, "flag_ptr": P, "err_ptr": P,
                                         "timeout_ns": "i64"}, {}),
    "cuda_ipc signal via": (ipc._signal_via_kernel, {"ctr_ptr": P, "table_ptr": P,
                                                     "word": "i32"}, {}),
    "cuda_ipc control via": (ipc._control_via_kernel,
                             {"ctr_ptr": P, "table_ptr": P, "num_tokens": "i32", "flags": "i32",
                              "ub1_tokens": "i32"}, {}),
    "cuda_ipc copy via": (ipc._copy_via_kernel, {"src_ptr": DATA, "table_ptr": P,
                                                 "offset": "i32", "n": "i32"}, BLOCK),
}  # fmt: skip


def _compile(name: str):
    fn, signature, constexprs = KERNELS[name]
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=HOPPER)  # fmt: skip


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_device_kernel_compiles_for_hopper(name):
    k = _compile(name)
    assert k.asm["cubin"], name
    assert ".target sm_90" in k.asm["ptx"], name


def test_the_nixl_wait_reads_the_gpu_clock_and_stores_its_duration():
    """The wait times out on the GPU's clock and stores how long it spun (the proxy's
    report reads it): the clock read after the loop and a third store (beside the error
    word and the counter) are in the code."""
    ptx = _compile("nixl wait").asm["ptx"]
    assert ptx.count("%globaltimer") >= 3, ptx  # before, in and after the spin
    assert ptx.count("st.global") >= 3, ptx
    ipc_ptx = _compile("cuda_ipc wait").asm["ptx"]
    assert ipc_ptx.count("st.global") < ptx.count("st.global")  # it stores no duration
