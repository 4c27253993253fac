"""What TorchTitan 0.3.0 needs to train on this machine's CPUs with gloo, and nothing more;
imported by a test's training script before TorchTitan (the integration itself changes none
of this).

- TorchTitan picks its device module when ``torchtitan.tools.utils`` is imported: CUDA where
  no accelerator is found. It is given the CPU, with the memory-statistics functions its
  metrics call answered.
- FlexAttention has no backward on CPU: its compiled call is replaced by the same masked
  attention through SDPA (the dense mask of the BlockMask's ``mask_mod``).
- TorchTitan calls ``torch.distributed.set_timeout``, newer than torch 2.13.
- TorchTitan divides gradients itself and sets FSDP2's divide factor to 1, which FSDP2 turns
  into a ``PREMUL_SUM(1.0)`` reduce-scatter that gloo cannot do: FSDP2 is told to reduce with
  a plain sum there instead (multiplying by 1 changes no bit).

The files the debug model reads are titan_assets.py's.
"""

from __future__ import annotations

import types

import torch
import torch._utils
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import distributed_c10d
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import create_mask


def _cpu_module() -> types.ModuleType:
    module = types.ModuleType("titan_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    module.get_device_name = lambda device=None: "cpu"
    module.current_device = lambda: 0
    module.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=1 << 34
    )
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    module.memory_stats = lambda device=None: {}
    return module


_found = torch._utils._get_available_device_type, torch._utils._get_device_module
torch._utils._get_available_device_type = lambda: "cpu"
torch._utils._get_device_module = lambda device_type: _cpu_module()
import torchtitan.tools.utils  # noqa: E402, F401  (reads the two above once)

torch._utils._get_available_device_type, torch._utils._get_device_module = _found

from torchtitan.models.common.attention import FlexAttention  # noqa: E402


def _dense_flex_attention(
    q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
    kernel_options=None,
):  # fmt: skip
    assert score_mod is None and (return_aux is None or not return_aux.lse)
    mask = create_mask(
        block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device
    )
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out, None


FlexAttention._compiled_flex_attn = staticmethod(_dense_flex_attention)

if not hasattr(dist, "set_timeout"):
    dist.set_timeout = distributed_c10d._set_pg_timeout

_set_factor = FSDPModule.set_gradient_divide_factor


def _set_gradient_divide_factor(module: FSDPModule, factor: float) -> None:
    _set_factor(module, factor)
    if factor == 1.0:
        module.set_force_sum_reduction_for_comms(True)


FSDPModule.set_gradient_divide_factor = _set_gradient_divide_factor
