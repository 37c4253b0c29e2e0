"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual stream is ``hc_mult`` parallel streams.

Before a block, a learned map of the (RMS-normalized, flattened) streams gives three sets of weights per token:
``pre`` collapses the streams into the block's input, ``post`` spreads the block's output back over the streams,
and ``comb`` (an ``n x n`` matrix made doubly stochastic by Sinkhorn-Knopp iterations) mixes the old streams into
the new ones: ``streams' = post * block(sum_i pre_i streams_i) + comb^T streams``. After the last layer a head of the
same kind collapses the streams once more. Parameter names follow the checkpoints (``fn``, ``base``, ``scale``;
``hc_fn``, ``hc_base``, ``hc_scale``); everything is computed in fp32, as DeepSeek does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import V4Config


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    keep_fp32 = True

    def __init__(self, hidden_size: int, v4: V4Config, eps: float) -> None:
        super().__init__()
        n = v4.hc_mult
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.eps = n, v4.hc_sinkhorn_iters, v4.hc_eps, eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams`` ``[T, n, hidden]`` -> ``(post [T, n], comb [T, n, n], collapsed [T, hidden])``."""
        n = self.hc_mult
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):  # rows, then columns, summing to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def combine(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                ) -> torch.Tensor:
        """The new streams: the block's output spread by ``post`` plus the old streams mixed by ``comb^T``."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """The last collapse of the streams, before the final norm."""

    keep_fp32 = True

    def __init__(self, hidden_size: int, v4: V4Config, eps: float) -> None:
        super().__init__()
        self.hc_eps, self.eps = v4.hc_eps, eps
        self.hc_fn = nn.Parameter(torch.empty(v4.hc_mult, v4.hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.empty(v4.hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
