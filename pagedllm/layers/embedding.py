"""Token embedding and LM head, with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communicator import communicator
from pagedllm.layers.linear import linear


class VocabEmbedding(nn.Module):
    """input_ids: [T] -> [T, H]. Rank r holds vocab rows [r * V/tp, (r+1) * V/tp), padded to a multiple of tp."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.vocab_start:self.vocab_start + self.num_per_partition]
        if shard.shape[1:] != param.shape[1:] or shard.shape[0] > param.shape[0]:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
        param.data[:shard.shape[0]].copy_(shard)
        param.data[shard.shape[0]:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_partition)
        y = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        communicator().all_reduce(y)
        return y


class ParallelLMHead(VocabEmbedding):
    """hidden [N, H] -> logits [N, V] in the weights' compute dtype (bf16 logits for a bf16 model, as its matmul
    rounds them: the sampler widens them to float32 where it computes with them, and a greedy batch's argmax reads
    them as they are). Shares the embedding's weight when embeddings are tied; `bias`: a logit bias of each token
    (Phi's), split across the ranks as the rows are."""

    packable_weight = True  # see pagedllm.layers.linear.pack_linear_weights

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1, bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, tp_rank, tp_size)
        self.bias = nn.Parameter(torch.empty(self.num_per_partition, dtype=dtype), requires_grad=False) \
            if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Rank 0 (the only one that samples) gets the whole vocabulary's logits, gathered from every rank's
        slice; another rank gets its own slice [N, V / tp]."""
        logits = linear(hidden, self.weight, self.bias)  # [N, V / tp]
        if self.tp_size > 1:
            parts = communicator().gather_to_first(logits)     # [tp, N, V / tp] on rank 0
            if parts is None:
                return logits
            logits = parts.permute(1, 0, 2).reshape(logits.shape[0], -1)
        return logits[:, :self.num_embeddings]
