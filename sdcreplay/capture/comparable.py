"""Which fingerprint properties a replay must share with the record: no torch needed.

Split from determinism.py so that ``sdcreplay info`` names them without
importing torch.
"""

from __future__ import annotations

# Compared between the record and a replica. The CPU model is compared only
# when MKL chose its kernels by CPU (no MKL_CBWR branch): MKL dispatches per
# CPU model, while ATen's kernels follow the capability alone.
RESULT_AFFECTING = (
    "torch.version",
    "torch.git",
    "cpu.capability",
    "cpu.blas_branch",
    "mkl",
    "onednn",
    "threads.intra_op",
    "gpu.name",
    "gpu.capability",
    "gpu.sm_count",
    "gpu.mig",
    "driver",
    "cuda.runtime",
    "cublas",
    "cudnn",
    "nccl",
    # NCCL's settings (determinism.NCCL_SETTINGS), in CUDA processes' fingerprints only
    "nccl.algo",
    "nccl.proto",
    "nccl.min_nchannels",
    "nccl.max_nchannels",
    "nccl.nvls_enable",
    "nccl.cross_nic",
)


def must_match(found: dict) -> dict:
    """The properties of ``found`` that a replay elsewhere must share to be compared bit for bit."""
    names = list(RESULT_AFFECTING) + (["cpu.model"] if found.get("cpu.blas_branch") is None else [])
    return {name: found[name] for name in names if name in found}
