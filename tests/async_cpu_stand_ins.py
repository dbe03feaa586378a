"""CPU stand-ins for the parts of TRL's asynchronous GRPO trainer that assume a GPU (test code, not in the package).

`AsyncGRPOTrainer` packs rollout samples into prefix trees and runs them through FlashAttention-3's varlen kernel
(loaded from the Hub) and asks CUDA for the device's peak FLOPs. `patch_for_cpu` replaces both in TRL's modules: the
kernel by `varlen_attention` (plain torch; tests/test_async_trainer.py checks it against an unpacked forward of each
sample), the FLOPs lookup by "unknown". Used by the main suite's async tests and by the real-vLLM tier's async run.
"""

from __future__ import annotations

import types

import torch


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                     causal=True, window_size=(-1, -1), **kwargs):  # fmt: skip
    """`flash_attn_varlen_func` in plain torch: segment s of the queries attends to keys `cu_seqlens_k[s]:[s+1]`,
    causally aligned bottom-right (the last query sees every key), grouped-query heads repeated."""
    assert causal and window_size == (-1, -1)
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    for s in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[s] : cu_seqlens_q[s + 1]].float()
        ks = k[cu_seqlens_k[s] : cu_seqlens_k[s + 1]].repeat_interleave(repeat, 1).float()
        vs = v[cu_seqlens_k[s] : cu_seqlens_k[s + 1]].repeat_interleave(repeat, 1).float()
        n_q, n_k = qs.shape[0], ks.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        visible = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu_seqlens_q[s] : cu_seqlens_q[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).to(q.dtype)
    return out


def patch_for_cpu(patch) -> None:
    """Apply the stand-ins with `patch` (a `pytest.MonkeyPatch`)."""
    import trl.experimental.async_grpo.async_grpo_trainer as async_module
    import trl.experimental.async_grpo.packing as packing

    patch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen_attention))
    patch.setattr(async_module, "get_peak_flops_per_device", lambda accelerator, dtype: None)
