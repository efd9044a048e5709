"""BERT-family encoders as embedding models: BERT (all-MiniLM, bge-small/base/large-en, e5, gte-base) and RoBERTa /
XLM-RoBERTa (bge-m3, multilingual-e5), from `BertModel`, `RobertaModel` and `XLMRobertaModel` checkpoints (with or
without the `bert.` / `roberta.` prefix of their task heads' checkpoints, whose heads are not read); and as
classifiers and cross-encoders (ms-marco-MiniLM, bge-reranker), from `*ForSequenceClassification` checkpoints, whose
head reads the prompt's first token: BERT's pooler (dense, tanh) then its classifier, RoBERTa's classifier (dense,
tanh, out_proj), run here as one `head`.

An encoder of post-norm layers: the embedding is the token's, its absolute position's and its token type's rows
summed and layer-normed (the token type is 0 unless the prompt gives its own: BERT's 1 for a pair's second text);
each layer adds the attention's output, then the MLP's (GELU), to its input, each sum layer-normed (LayerNorm with
biases). Every token attends to the whole prompt (`bidirectional_attention`), so, like
EmbeddingGemma (`attends_both_ways`), it embeds whole prompts and never generates, and its K/V never outlive their
step. RoBERTa's positions start after its padding id (`padding_idx + 1`), so its context is two positions short of
`max_position_embeddings`.

The same interface as `LlamaForCausalLM` for the runner: `forward` (the final hidden states), `compute_logits` (the
word embeddings standing in as the head), `classify`, `load_weights`.
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
from pagedllm.layers.norm import LayerNorm
from pagedllm.models.llama import ENCODER_CLASSIFIER_ARCHITECTURES

# checkpoint name part -> this module's, in order (the q/k/v weights go to the fused qkv_proj: _QKV)
_RENAMES = [("encoder.layer.", "layers."), ("attention.output.dense.", "o_proj."),
            ("attention.output.LayerNorm.", "attention_norm."), ("intermediate.dense.", "up_proj."),
            ("output.dense.", "down_proj."), ("output.LayerNorm.", "mlp_norm."),
            ("embeddings.LayerNorm.", "embeddings.norm.")]
_QKV = {"attention.self.query.": "q", "attention.self.key.": "k", "attention.self.value.": "v"}
_ROBERTA_TYPES = ("roberta", "xlm-roberta")
# a sequence classifier's head tensors -> `head`'s (RoBERTa's classifier.dense/out_proj before BERT's classifier)
_HEAD_RENAMES = [("pooler.dense.", "head.0."), ("classifier.dense.", "head.0."), ("classifier.out_proj.", "head.2."),
                 ("classifier.", "head.2.")]


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
        self.attention_norm = LayerNorm(hidden, eps, dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden, config.intermediate_size, bias=True, dtype=dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, hidden, bias=True, dtype=dtype)
        self.mlp_norm = LayerNorm(hidden, eps, dtype=dtype)
        act = config.hidden_act
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden activation {act!r} is not supported (only 'gelu' and its tanh approximation)")
        self.approximate = "none" if act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.q_size, dim=-1)
        heads = (-1, self.qkv_proj.q_size // self.head_dim, self.head_dim)
        out = bidirectional_attention(q.view(heads), k.view(heads), v.view(heads), meta, self.head_dim ** -0.5)
        x = self.attention_norm(self.o_proj(out.flatten(1)), x)
        # GELU in place: a fresh [T, intermediate] output would cost its page faults (~20% of the GELU)
        return self.mlp_norm(self.down_proj(torch.ops.aten.gelu_(self.up_proj(x), approximate=self.approximate)), x)


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size, dtype=dtype)
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)
        self.offset = position_offset(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
                ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
        types = self.token_type_embeddings.weight[0] if token_type_ids is None else \
            self.token_type_embeddings(token_type_ids)
        return self.norm(x, types)


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
        # a sequence classifier's head, in float32 as the pooled rows it reads; None for an embedding model
        hidden = config.hidden_size
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, config.num_labels)) \
            if ENCODER_CLASSIFIER_ARCHITECTURES & set(config.architectures or []) else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def use_decoder_stack(self) -> None:
        """The decoder stack runs Llama-family decoders only: the modules run."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, lora: Any = None, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (each prompt whole in the step), token_type_ids [T] (None: all 0) -> the last
        layer's hidden states [T, H]; the K/V stay in the step (`kv_caches` unused)."""
        if lora is not None:
            raise ValueError("a BERT-family encoder takes no LoRA adapter")
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> [N, V] float32 through the word embeddings: the runner's LM-head interface (its profile
        step on a GPU); an encoder has no LM head, and a pooling request's one token skips it
        (`ModelRunner._sample_all_but_embeddings`)."""
        weight = self.embeddings.word_embeddings.weight       # in its dtype: widening it took 20 ms a step
        return F.linear(hidden.to(weight.dtype), weight).float()

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (the prompts' first tokens') -> the classification head's logits [N, num_labels] float32
        (a `*ForSequenceClassification` checkpoint's only)."""
        if self.head is None:
            raise ValueError("this model has no classification head")
        return self.head(hidden.float())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (BERT's names, with or without a task head's `bert.`/`roberta.` prefix; position
        ids, and the pooler and any head but a sequence classifier's, skipped); ValueError if a parameter is left
        unloaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.").removeprefix("roberta.")
            if self.head is not None and name.startswith(("pooler.", "classifier.")):
                name = next(name.replace(old, new, 1) for old, new in _HEAD_RENAMES if name.startswith(old))
            elif name.startswith(("pooler.", "cls.", "lm_head.", "classifier.")) or name.endswith("position_ids"):
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
