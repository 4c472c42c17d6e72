"""Loaded by every process of the torchtitan launcher test (it is on their PYTHONPATH only): what torchtitan 0.3.0's
stock Trainer needs to run on a CPU-only machine with gloo and the released torch. Each shim names the line that stops
the stock run without it (tests/integrations/test_torchtitan_launcher.py):

1. torchtitan/tools/utils.py:55 ``device_type = _get_available_device_type() or "cuda"``: with no accelerator the
   trainer takes CUDA, and trainer.py:301 ``device_module.set_device(self.device)`` raises ``AttributeError: module
   'torch._C' has no attribute '_cuda_setDevice'``. Here the device is the CPU, with the few calls torchtitan makes of a
   device module (metrics.py:42-62, distributed/utils.py:586) answered for it; the process group is then gloo
   (distributed/utils.py ``_get_distributed_backend``).
2. distributed/utils.py:595 ``torch.distributed.set_timeout(timeout, group)``, after the first step: a function of
   torch's nightly builds that the released torch lacks (``AttributeError: module 'torch.distributed' has no attribute
   'set_timeout'``); here it is torch's own ``_set_pg_timeout``.
3. distributed/fsdp.py:41 ``module.set_gradient_divide_factor(1.0)`` makes FSDP2 reduce gradients with
   ``ReduceOp.PREMUL_SUM(1.0)`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:850), which gloo refuses
   (``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``); here FSDP2 sums instead (its
   ``set_force_sum_reduction_for_comms``), which with a factor of 1 is the same sum.
"""

import os

if "LOCAL_RANK" in os.environ:  # the trainer's processes, not torchrun's agent
    import types

    import torch
    import torch.distributed as dist
    import torchtitan.tools.utils as titan_utils
    from torch.distributed.fsdp import FSDPModule

    class _CpuProperties:
        name = "cpu"
        total_memory = 1 << 34

    cpu = types.SimpleNamespace(**{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")})
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: _CpuProperties
    cpu.current_device = lambda: 0
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.memory_stats = lambda device=None: {}
    titan_utils.device_type, titan_utils.device_module = "cpu", cpu

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout

    _set_factor = FSDPModule.set_gradient_divide_factor

    def _set_gradient_divide_factor(self, factor):
        _set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = _set_gradient_divide_factor
