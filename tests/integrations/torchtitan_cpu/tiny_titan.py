"""A torchtitan ``config_registry`` module for the launcher test (``--module tiny_titan --config tiny``): torchtitan's
llama3 debug model cut to 2 layers, a local tokenizer and dataset that the test writes into the working directory, and
an override (torchtitan's own mechanism) for its attention: ``flex_attention`` has no backward on CPU
(torch/nn/attention/flex_attention.py:2082, ``NotImplementedError: FlexAttention does not support backward on CPU``),
so the same masks go through ``scaled_dot_product_attention`` as a dense mask."""

from dataclasses import dataclass

import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel


class DenseMaskAttention(FlexAttention):
    """FlexAttention's block masks applied densely by SDPA (shapes in torchtitan's (batch, length, heads, dim))."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
        mask = create_mask(attention_masks.mask_mod, q.shape[0], 1, q.shape[1], k.shape[1], device=q.device)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


@override(target=FlexAttention.Config, description="flex attention's masks through SDPA, which has a CPU backward")
def cpu_attention(config):
    return DenseMaskAttention.Config()


def tiny():
    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    config.hf_assets_path = "tokenizer"
    config.dataloader.dataset_path = "c4_test"  # the c4_test format: JSON lines of {"text": ...}
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.steps = 6
    config.validator.enable = False
    # the default "spmd_types" backend refuses the FSDP of this torch build (trainer.py:491: "When dp_mesh_dims is
    # provided, all parameters must be DTensors on the full SPMD mesh"); "partial_dtensor" is plain FSDP2
    config.parallelism.spmd_backend = "partial_dtensor"
    return config
