"""BERT-family encoders as embedding models: BERT (all-MiniLM, bge-small/base/large-en, e5, gte-base) and RoBERTa /
XLM-RoBERTa (bge-m3, multilingual-e5), from `BertModel`, `RobertaModel` and `XLMRobertaModel` checkpoints (with or
without the `bert.` / `roberta.` prefix of their task heads' checkpoints, which are not read).

An encoder of post-norm layers: the embedding is the token's, its absolute position's and its token type's (0) rows
summed and layer-normed; each layer adds the attention's output, then the MLP's (GELU), to its input, each sum
layer-normed (LayerNorm with biases). Every token attends to the whole prompt (`bidirectional_attention`), so, like
EmbeddingGemma (`attends_both_ways`), it embeds whole prompts and never generates, and its K/V never outlive their
step. RoBERTa's positions start after its padding id (`padding_idx + 1`), so its context is two positions short of
`max_position_embeddings`.

The same interface as `LlamaForCausalLM` for the runner: `forward` (the final hidden states), `compute_logits` (the
word embeddings as the head, for the one token an embedding request samples, unseen), `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.cpu import bidirectional_attention
from pagedllm.attention.metadata import AttentionBackend, AttentionMetadata, KVCache
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

# checkpoint name part -> this module's, in order (the q/k/v weights go to the fused qkv_proj: _QKV)
_RENAMES = [("encoder.layer.", "layers."), ("attention.output.dense.", "o_proj."),
            ("attention.output.LayerNorm.", "attention_norm."), ("intermediate.dense.", "up_proj."),
            ("output.dense.", "down_proj."), ("output.LayerNorm.", "mlp_norm."),
            ("embeddings.LayerNorm.", "embeddings.norm.")]
_QKV = {"attention.self.query.": "q", "attention.self.key.": "k", "attention.self.value.": "v"}
_ROBERTA_TYPES = ("roberta", "xlm-roberta")


def position_offset(config: Any) -> int:
    """Where a sequence's positions start in the position embeddings: RoBERTa's after its padding id, BERT's at 0."""
    return config.pad_token_id + 1 if config.model_type in _ROBERTA_TYPES else 0


class BertLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        eps = config.layer_norm_eps
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True, dtype=dtype)
        self.o_proj = RowParallelLinear(hidden, hidden, bias=True, dtype=dtype)
        self.attention_norm = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden, config.intermediate_size, bias=True, dtype=dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, hidden, bias=True, dtype=dtype)
        self.mlp_norm = nn.LayerNorm(hidden, eps, dtype=dtype)
        act = config.hidden_act
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden activation {act!r} is not supported (only 'gelu' and its tanh approximation)")
        self.approximate = "none" if act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.q_size, dim=-1)
        heads = (-1, self.qkv_proj.q_size // self.head_dim, self.head_dim)
        out = bidirectional_attention(q.view(heads), k.view(heads), v.view(heads), meta, self.head_dim ** -0.5)
        x = self.attention_norm(x + self.o_proj(out.flatten(1)))
        return self.mlp_norm(x + self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate)))


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size, dtype=dtype)
        self.norm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)
        self.offset = position_offset(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
        return self.norm(x + self.token_type_embeddings.weight[0])


class BertModel(nn.Module):
    """A BERT-family encoder over the engine's steps (see the module docstring). The attention backend and the
    tensor-parallel rank are taken for the loader's sake: the layers attend through `bidirectional_attention`, on one
    rank."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, attn_backend: AttentionBackend | None = None,
                 tp_rank: int = 0, tp_size: int = 1, max_positions: int | None = None) -> None:
        super().__init__()
        if tp_size > 1:
            raise ValueError("a BERT-family encoder runs on one rank (tensor_parallel_size=1)")
        self.config = config
        self.dtype = dtype
        self.embeddings = BertEmbeddings(config, dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def use_decoder_stack(self) -> None:
        """The decoder stack runs Llama-family decoders only: the modules run."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: Any = None) -> torch.Tensor:
        """input_ids, positions: [T] (each prompt whole in the step) -> the last layer's hidden states [T, H]; the
        K/V stay in the step (`kv_caches` unused)."""
        if lora is not None:
            raise ValueError("a BERT-family encoder takes no LoRA adapter")
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> [N, V] float32 through the word embeddings: only for the one token an embedding request
        samples, which nobody sees (an encoder has no LM head)."""
        weight = self.embeddings.word_embeddings.weight       # in its dtype: widening it took 20 ms a step
        return F.linear(hidden.to(weight.dtype), weight).float()

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("this model has no classification head")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (BERT's names, with or without a task head's `bert.`/`roberta.` prefix; its
        pooler, position ids and any head skipped); ValueError if a parameter is left unloaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.").removeprefix("roberta.")
            if name.startswith(("pooler.", "cls.", "lm_head.", "classifier.")) or name.endswith("position_ids"):
                continue
            shard = next((shard for part, shard in _QKV.items() if part in name), None)
            for part in _QKV:
                name = name.replace(part, "qkv_proj.")
            for old, new in _RENAMES:
                name = name.replace(old, new)
            if name not in params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            param = params[name]
            if shard is not None:
                param.weight_loader(param, tensor, shard)
            else:
                param.data.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"the checkpoint has no weights for {sorted(missing)[:5]}")
        return loaded
