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


# Without a kernel probe in the bundle (capture/probe.py) nothing shows that another CPU model
# computes alike, whatever a BLAS branch promises: the model is then compared too.
MODELS = ("cpu.model", "gpu.name")


def must_match(found: dict, probed: bool = True) -> dict:
    """The properties of ``found`` that a replay elsewhere must share to be compared bit for bit
    (``probed``: the bundle has a kernel probe, which judges what the list cannot)."""
    names = list(RESULT_AFFECTING) + (["cpu.model"] if found.get("cpu.blas_branch") is None else [])
    if not probed:
        names += [name for name in MODELS if name not in names]
    return {name: found[name] for name in names if name in found}
