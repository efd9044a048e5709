"""The model runner: executes one scheduler step on the device.

`prepare` moves the blocks the scheduler asked to move (once a step); `run` builds the flat inputs, runs the
model over the paged KV cache and samples, for all of the step's requests or, when a run raised, for a part of
them. It never decides policy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import CacheConfig, LoRAConfig
from pagedllm.core.request import child_seed
from pagedllm.core.sched.output import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.distributed import Peers
from pagedllm.kernels import kernels_fixed
from pagedllm.layers.linear import head_shard
from pagedllm.loader import LoadedModel
from pagedllm.loader.pooling_config import sentence_transformers_projector
from pagedllm.lora.adapter import LoRAAdapter, LoRABatch, LoRARegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.models.llama import cache_layers, has_conv_layers
from pagedllm.models.mla import is_mla, mla_cache_row
from pagedllm.models.recurrent import RecurrentMixer, RecurrentStates
from pagedllm.models.vision import ImageRows
from pagedllm.multimodal import MRopeLayout
from pagedllm.pooling_params import PoolingParams
from pagedllm.runner import kv_tensors
from pagedllm.runner.cuda_graphs import Capture, DecodeGraphs, capture_sizes, cuda_capture
from pagedllm.runner.input_batch import CachedRequestState, ModelInputs, build_model_inputs
from pagedllm.sample.logits_processor import CustomLogits
from pagedllm.sample.metadata import SamplingMetadata, SamplingRow, make_generator
from pagedllm.sample.sampler import Sampler, position_logprobs
from pagedllm.spec_decode.rejection_sampler import verify_drafts
from pagedllm.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.spec_decode.draft_model import DraftModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def model_shape(hf_config, tp_rank: int = 0, tp_size: int = 1) -> ModelShape:
    """The model's shape as rank `tp_rank` of `tp_size` holds it (num_kv_heads: this rank's KV heads). A latent
    attention's (DeepSeek's) pool holds one row a token, its latent and rotary key (pagedllm.models.mla)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if is_mla(hf_config):
        head_dim, num_kv_heads = mla_cache_row(hf_config), 1
    heads = head_shard(hf_config.num_attention_heads, num_kv_heads, tp_rank, tp_size)
    num_layers = cache_layers(hf_config)[-1].stop     # the KV pool's layers (LFM2's convolutions may take more)
    return ModelShape(num_layers, heads.num_kv_heads, head_dim, hf_config.vocab_size)


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass(slots=True)
class StepTimings:
    """What the last `execute()` took, for the swap-or-recompute costs. On a CPU the clock reads true times; on a
    GPU kernels run asynchronously, so the times are those of the launches."""

    swap_seconds: float = 0.0         # swap-outs and swap-ins
    num_swapped_blocks: int = 0
    forward_seconds: float = 0.0      # the model's forward pass
    num_tokens: int = 0               # the tokens it ran


class ModelRunner:
    """Owns the model, the KV tensors and each request's sampling state (with its grammar matcher, for
    structured outputs from `structured_output`).

    Under tensor parallelism every rank has one, over its slice of the model and its KV heads; rank 0's sends
    each rank-wide operation (KV and swap allocation, block moves, forward passes, logits) to the others through
    `peers` before doing its own part (pagedllm/distributed), and alone holds requests and samples.

    With a `draft` model (draft-model speculative decoding, one rank), it also proposes each step's drafts for
    the next (`pagedllm.spec_decode.draft_model`).
    """

    def __init__(self, loaded: LoadedModel, cache_config: CacheConfig, eos_token_id: int | None,
                 seed: int = 0, structured_output: StructuredOutputManager | None = None,
                 peers: Peers | None = None, lora_config: LoRAConfig | None = None,
                 draft: DraftModel | None = None, logprobs_mode: str = "raw_logprobs",
                 custom_logits: CustomLogits | None = None) -> None:
        self.model = loaded.model
        # whether the model places image tokens by M-RoPE (the Qwen-VLs'): their requests' positions are shifted
        self.mrope = getattr(getattr(self.model, "model", None), "mrope", None) is not None
        self.draft = draft
        self.loras = (LoRARegistry(self.model, lora_config.max_lora_rank, lora_config.capacity)
                      if lora_config is not None else None)
        self.tp_rank = loaded.tp_rank
        self.quantization = loaded.quantization
        self.attn_backend = loaded.attn_backend
        self.cascade = loaded.cascade
        self.peers = peers or Peers()
        self.device = next(self.model.parameters()).device
        # the sentence-transformers Dense layers an embedding passes through after its pooling (EmbeddingGemma's)
        projector = sentence_transformers_projector(loaded.resolved, loaded.gguf_file)
        self.projector = projector.to(self.device) if projector is not None else None
        self.shape = model_shape(loaded.hf_config, loaded.tp_rank, loaded.tp_size)
        if cache_config.kv_cache_dtype == "int8" and has_conv_layers(loaded.hf_config):
            raise ValueError("kv_cache_dtype 'int8' stores attention K/V rows, not the convolution inputs an LFM2 "
                             "model keeps in the pool: use 'auto'")
        self.layout = kv_tensors.KVLayout(self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim,
                                          loaded.dtype, cache_config.kv_cache_dtype)
        self.block_size = cache_config.block_size
        self.eos_token_id = eos_token_id
        self.sampler = Sampler(logprobs_mode, custom_logits)
        self.structured_output = structured_output
        self.requests: dict[str, CachedRequestState] = {}
        self.global_generator = make_generator(seed, self.device)
        self.kv: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.swap: kv_tensors.SwapSpace | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.last_timings = StepTimings()
        # recurrent layers' per-request states (`allocate_recurrent_states`); None for a model without them
        self.mixers = [m for m in self.model.modules() if isinstance(m, RecurrentMixer)]
        self.recurrent: RecurrentStates | None = None

    @property
    def embedding_size(self) -> int:
        """An embedding's length: the last Dense layer's outputs (a sentence-transformers projector's), else the
        model's hidden size."""
        if self.projector is not None:
            return [m for m in self.projector.modules() if isinstance(m, torch.nn.Linear)][-1].out_features
        return self.model.config.hidden_size

    def weight_bytes(self) -> int:
        """The model's weights, and the draft model's."""
        return parameter_bytes(self.model) + (parameter_bytes(self.draft.model) if self.draft is not None else 0)

    @property
    def kv_bytes_per_token(self) -> int:
        """A token's K/V in the pool: the model's, and the draft model's beside it."""
        draft = self.draft.layout.bytes_per_token if self.draft is not None else 0
        return self.layout.bytes_per_token + draft

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.decode_graphs = None   # they read the old pool
        with self.peers.run("allocate_kv_cache", num_blocks, wait=True):
            self.kv = kv_tensors.allocate_kv(self.layout, num_blocks, self.block_size, self.device)
            self.kv_caches = kv_tensors.layer_caches(self.kv)
            if self.draft is not None:
                self.draft.allocate_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        """Free the KV pool's memory (the engine's sleep mode) on every rank; allocate_kv_cache brings it back."""
        self.decode_graphs = None
        with self.peers.run("release_kv_cache", wait=True):
            self.kv, self.kv_caches = None, []
            if self.draft is not None:
                self.draft.release_kv_cache()

    @property
    def recurrent_bytes_per_request(self) -> int:
        """A running request's two slots of recurrent states (0 for a model without recurrent layers)."""
        return RecurrentStates.bytes_per_request(self.mixers, self.layout.dtype)

    def allocate_recurrent_states(self, num_requests: int) -> None:
        """Slots for `num_requests` running requests' recurrent states (a model with recurrent layers; one rank)."""
        self.recurrent = RecurrentStates(self.mixers, num_requests, self.layout.dtype, self.device)

    def allocate_swap_space(self, num_blocks: int, path: str | None = None) -> None:
        """The swap pool: pinned host memory beside a GPU, a memory-mapped file on a CPU device (rank r > 0 of a
        tensor-parallel group puts its own beside the named one, as `path.rank<r>`)."""
        with self.peers.run("allocate_swap_space", num_blocks, path, wait=True):
            path = f"{path}.rank{self.tp_rank}" if path is not None and self.tp_rank else path
            self.swap = kv_tensors.SwapSpace(self.layout, num_blocks, self.block_size, self.device, path)

    def close(self) -> None:
        """Release the swap pool (closing and deleting its file) and stop the tensor-parallel workers; closing
        twice does nothing more. A worker that was killed could not delete its swap file: rank 0 deletes what is
        left of theirs beside its own."""
        self.peers.close()
        if self.swap is not None:
            path = self.swap.path
            self.swap.close()
            self.swap = None
            worker_paths = [f"{path}.rank{rank}" for rank in range(1, self.peers.size)] if path is not None else []
            for worker_path in worker_paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(worker_path)

    @torch.inference_mode()
    def move_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                    copies: list[tuple[int, int]]) -> None:
        """Swap-out, then swap-in, then copy-on-write copies: the order SchedulerOutput promises."""
        if not (swap_out or swap_in or copies):
            return
        with self.peers.run("move_blocks", swap_out, swap_in, copies):
            assert self.kv is not None, "allocate_kv_cache() must run before prepare()"
            if swap_out or swap_in:
                assert self.swap is not None, "the scheduler swapped without a swap pool"
                start = time.perf_counter()
                self.swap.move(self.kv, swap_out, swap_in)
                self.last_timings.swap_seconds = time.perf_counter() - start
                self.last_timings.num_swapped_blocks = len(swap_out) + len(swap_in)
            kv_tensors.copy_blocks(self.kv, copies)
            if self.draft is not None:
                self.draft.copy_blocks(copies)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                lora: LoRABatch | None = None, token_type_ids: torch.Tensor | None = None,
                image_rows: ImageRows | None = None) -> torch.Tensor:
        """The model over the paged KV cache: [T] ids and positions -> hidden states [T, H] (on every rank), with
        `lora`'s adapters on their rows, `token_type_ids` [T] (a BERT-family encoder's) added and `image_rows`
        standing in for image placeholders' embeddings (one rank only)."""
        extra: dict[str, object] = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        if image_rows is not None:
            extra["image_rows"] = image_rows
        with self.peers.run("forward", input_ids, positions, meta), kernels_fixed():
            return self.model(input_ids, positions, self.kv_caches, meta, lora, **extra)

    def load_lora(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, loaded now if it is not (ValueError for one that cannot be, or with LoRA off)."""
        if self.loras is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} asked for, but LoRA is off: start the engine with "
                             "enable_lora=True (--enable-lora)")
        return self.loras.get(request)

    @torch.inference_mode()
    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: Capture | None = None) -> None:
        """Capture the decode steps of up to max_num_seqs sequences (`cuda_graphs`), into CUDA graphs unless
        `capture` says otherwise; after allocate_kv_cache, on one rank."""
        assert self.kv is not None and self.peers.size == 1, "capture after allocate_kv_cache(), on one rank"
        self.decode_graphs = DecodeGraphs(self.forward, capture_sizes(max_num_seqs),
                                          -(-max_model_len // self.block_size), self.device,
                                          capture or cuda_capture())

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V], float32 or the LM head's dtype (on rank 0; a worker gets its vocabulary
        slice)."""
        with self.peers.run("compute_logits", hidden), kernels_fixed():
            return self.model.compute_logits(hidden)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """The whole step at once: `prepare`, then `run` every scheduled request."""
        self.prepare(scheduler_output)
        return self.run(scheduler_output.scheduled)

    @torch.inference_mode()
    def prepare(self, scheduler_output: SchedulerOutput) -> None:
        """What a step does exactly once, before any forward pass: drop the finished requests' state, take the
        new ones', and move blocks (swap out, swap in, copy-on-write)."""
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        if self.recurrent is not None:     # a preempted request runs again from its first token
            for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
                self.recurrent.release(request_id)
        # A preempted request keeps its state here (above all its seeded generator, so that its samples do not
        # depend on whether it was preempted); it comes back through new_requests and is recognised.
        for new in scheduler_output.new_requests:
            self._add_request(new)
        self.last_timings = StepTimings()
        self.move_blocks(scheduler_output.blocks_to_swap_out, scheduler_output.blocks_to_swap_in,
                         scheduler_output.blocks_to_copy)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        """Run the model and sample for some or all of a prepared step's requests.

        It writes only the K/V slots of these requests' new tokens, and appends their sampled tokens to their
        state only once the whole group is sampled, so a group that raised may be run again (in parts): the
        rerun writes the same slots again.
        """
        if not scheduled:
            return RunnerOutput()
        inputs = build_model_inputs(scheduled, self.block_size, self.device, self.cascade)
        recurrent = self.recurrent.begin(scheduled) if self.recurrent is not None else None
        inputs.meta.recurrent = recurrent
        if self.mrope:
            self._shift_positions(inputs, scheduled)
        pending_masks = self._start_token_bitmasks(inputs.sample_request_ids)
        start = time.perf_counter()
        try:
            hidden = self._forward_step(inputs, self._lora_batch(inputs, scheduled),
                                        self._token_types(inputs, scheduled), self._image_rows(inputs, scheduled))
            prompt_logprobs, reported = self._prompt_logprobs(hidden, inputs, scheduled)
        except BaseException:
            _wait_token_bitmasks(pending_masks)   # the fill reads the matchers: done before any rerun touches them
            raise
        self.last_timings.forward_seconds = time.perf_counter() - start
        self.last_timings.num_tokens = len(inputs.input_ids)
        output = RunnerOutput()
        if inputs.sample_request_ids:
            children = {s.request_id: s.child_request_ids for s in scheduled if s.child_request_ids}
            drafts = {s.request_id: s.spec_token_ids for s in scheduled if s.spec_token_ids}
            masks = _wait_token_bitmasks(pending_masks)
            output = (self._sample_with_drafts(hidden, inputs, children, drafts, masks) if drafts else
                      self._sample_all_but_embeddings(hidden, inputs.logits_indices, inputs.sample_request_ids,
                                                      children, masks))
        for state, end in reported:   # only once the group succeeded: a group that raised may run again
            state.num_prompt_logprob_positions = end
        if self.recurrent is not None and recurrent is not None:
            self.recurrent.commit(recurrent, {s.request_id: s.child_request_ids for s in scheduled
                                              if s.child_request_ids})
        output.prompt_logprobs = prompt_logprobs
        output.embeddings = self._embeddings(hidden, inputs, scheduled)
        self._propose_drafts(scheduled, output)
        return output

    def _propose_drafts(self, scheduled: list[ScheduledRequest], output: RunnerOutput) -> None:
        """The draft model's drafts for the next step of each request scheduled with lookahead slots. Drafts only
        ever speed a request up: a draft model that raises is logged and turned off (`draft_model_off` tells the
        scheduler to stop reserving its slots), and the step goes on."""
        if self.draft is None:
            return
        wanted = [(self.requests[s.request_id], s.block_ids, s.num_lookahead_tokens)
                  for s in scheduled if s.num_lookahead_tokens]
        if not wanted:
            return
        try:
            output.draft_token_ids = self.draft.propose(wanted)
        except Exception:
            logger.exception("the draft model %s failed: speculative decoding is off from now on", self.draft.name)
            self.draft = None
            output.draft_model_off = True

    def _embeddings(self, hidden: torch.Tensor, inputs: ModelInputs, scheduled: list[ScheduledRequest]
                    ) -> dict[str, list[float]]:
        """Each pooling request whose prompt's last token ran this step: its pooled final hidden state
        (`PoolingParams.pooling_type`: the last token's, the mean over the prompt's, or the first token's, gathered
        chunk by chunk), in float32. An embedding passes through the model's Dense layers, if it has any
        (`projector`), and is L2-normalised unless it asks otherwise; a classification is the head's logits, as
        probabilities unless it asks otherwise."""
        result = {}
        embeddings: dict[str, tuple[torch.Tensor, PoolingParams]] = {}     # request id -> (pooled vector, params)
        for s in scheduled:
            state = self.requests[s.request_id]
            pooling = state.pooling
            if pooling is None:
                continue
            rows = hidden[inputs.first_rows[s.request_id]:inputs.first_rows[s.request_id] + len(s.token_ids)]
            if pooling.needs_every_position:
                if s.num_computed_tokens == 0:      # the prompt's first chunk (again, after a recompute)
                    state.pooled_chunks.clear()
                if pooling.pooling_type == "MEAN":
                    state.pooled_chunks[s.num_computed_tokens] = rows.float().sum(0)
                elif s.num_computed_tokens == 0:
                    state.pooled_chunks[0] = rows[0].float()
            if not s.sample:
                continue
            if pooling.pooling_type == "MEAN":
                vector = torch.stack(list(state.pooled_chunks.values())).sum(0) / len(state.prompt_token_ids)
            elif pooling.pooling_type == "CLS":
                vector = state.pooled_chunks[0]
            else:
                vector = rows[-1].float()
            if pooling.task == "classify":
                vector = self.model.classify(vector[None])[0]
                if pooling.use_activation:
                    vector = vector.sigmoid() if len(vector) == 1 else vector.softmax(0)
                result[s.request_id] = vector.tolist()
            else:
                embeddings[s.request_id] = (vector, pooling)
        if embeddings:      # the step's embeddings through the Dense layers together: one product per layer
            vectors = torch.stack([vector for vector, _ in embeddings.values()])
            if self.projector is not None:
                vectors = self.projector(vectors)
            for (request_id, (_, pooling)), vector in zip(embeddings.items(), vectors):
                vector = vector[:pooling.dimensions]        # a Matryoshka model's shorter embedding, or all of it
                result[request_id] = (torch.nn.functional.normalize(vector, dim=0) if pooling.normalize
                                      else vector).tolist()
        return result

    def _forward_step(self, inputs: ModelInputs, lora: LoRABatch | None, token_types: torch.Tensor | None,
                      image_rows: ImageRows | None) -> torch.Tensor:
        """The step's forward pass: a captured graph's replay when one covers it, else eager."""
        graphs = self.decode_graphs
        if graphs is not None and lora is None and token_types is None and image_rows is None and \
                graphs.covers(inputs.meta):
            return graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.forward(inputs.input_ids, inputs.positions, inputs.meta, lora, token_types, image_rows)

    def _shift_positions(self, inputs: ModelInputs, scheduled: list[ScheduledRequest]) -> None:
        """M-RoPE: the positions of the tokens after a grid image, shifted as its layout says (`MRopeLayout`)."""
        for s in scheduled:
            layout = self.requests[s.request_id].mrope
            if layout is not None:
                row, start = inputs.first_rows[s.request_id], s.num_computed_tokens
                shifts = [layout.shift(index) for index in range(start, start + len(s.token_ids))]
                inputs.positions[row:row + len(shifts)] += torch.tensor(shifts, device=inputs.positions.device)

    def _image_rows(self, inputs: ModelInputs, scheduled: list[ScheduledRequest]) -> ImageRows | None:
        """Where the step's tokens reach image placeholders: those rows of the step, the image encoder's rows for
        them (each image encoded at the first step that reaches it) and, for grid images, their M-RoPE positions;
        None when no token is an image's."""
        indices, rows, positions = [], [], []
        for s in scheduled:
            state = self.requests[s.request_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)
            for index, image in enumerate(state.images):
                first, last = max(start, image.offset), min(end, image.offset + image.length)
                if first >= last:
                    continue
                if index not in state.image_rows:
                    state.image_rows[index] = self.model.encode_image(image)
                row = inputs.first_rows[s.request_id] + first - start
                places = torch.arange(first - image.offset, last - image.offset)    # in the image's run
                step_rows = torch.arange(row, row + last - first)
                if image.row_width is not None:     # the rows' ends ([IMG_BREAK]) keep their own embeddings
                    keep = places % (image.row_width + 1) != image.row_width
                    places, step_rows = places[keep] - places[keep] // (image.row_width + 1), step_rows[keep]
                indices.append(step_rows)
                rows.append(state.image_rows[index][places])
                if not image.embeds and self.model.image_encoder.attends_whole_image:   # its rows see all of it
                    if last != image.offset + image.length:
                        raise RuntimeError(f"a step cut image {index} of {s.request_id}: the scheduler keeps an "
                                           "image whole for this model")
                    span = AttentionMetadata.build([s.block_ids], [first], [last - first], self.block_size,
                                                   self.device)
                    inputs.meta.image_spans.append((slice(row, row + last - first), span))
                if state.mrope is not None:
                    positions.append(torch.tensor(state.mrope.image_positions(image, first, last)))
        if not rows:
            return None
        return ImageRows(torch.cat(indices).to(self.device), torch.cat(rows),
                         torch.cat(positions, dim=1).to(self.device) if positions else None)

    def _token_types(self, inputs: ModelInputs, scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        """The step's token type ids [T] when a request of it has its own (a cross-encoder's pair: the engine takes
        them for an encoder's prompts only); None when all are 0."""
        typed = [(s, types) for s in scheduled if (types := self.requests[s.request_id].token_type_ids) is not None]
        if not typed:
            return None
        result = torch.zeros(len(inputs.input_ids), dtype=torch.long)
        for s, types in typed:
            first, start = inputs.first_rows[s.request_id], s.num_computed_tokens
            result[first:first + len(s.token_ids)] = torch.tensor(types[start:start + len(s.token_ids)])
        return result.to(self.device)

    def _lora_batch(self, inputs: ModelInputs, scheduled: list[ScheduledRequest]) -> LoRABatch | None:
        """The step's LoRA adapters and each one's rows; None when no request of the step has one."""
        if self.loras is None:
            return None
        groups: dict[int, tuple[LoRARequest, list[int]]] = {}    # adapter id -> (its request, its rows)
        for s in scheduled:
            lora = self.requests[s.request_id].lora
            if lora is not None:
                first = inputs.first_rows[s.request_id]
                groups.setdefault(lora.lora_int_id, (lora, []))[1].extend(range(first, first + len(s.token_ids)))
        if not groups:
            return None
        return LoRABatch([(self.load_lora(lora), torch.tensor(rows, device=self.device))
                          for lora, rows in groups.values()], len(inputs.input_ids))

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: ModelInputs, scheduled: list[ScheduledRequest]
                         ) -> tuple[dict[str, list], list[tuple[CachedRequestState, int]]]:
        """For each request that wants prompt logprobs: the logprobs of the prompt tokens its rows predict this
        step (row p predicts prompt token p + 1), from raw logits, skipping positions already reported; and, for
        the caller to record once the step succeeded, each state with the end of the positions reported now."""
        result, reported = {}, []
        for s in scheduled:
            state = self.requests[s.request_id]
            num = state.params.prompt_logprobs
            start = max(s.num_computed_tokens, state.num_prompt_logprob_positions)
            end = min(s.num_computed_tokens + s.num_new_tokens, len(state.prompt_token_ids) - 1)
            if num is None or start >= end:
                continue
            row = inputs.first_rows[s.request_id] + start - s.num_computed_tokens
            logits = self.compute_logits(hidden[row:row + end - start])             # [end - start, vocab]
            targets = torch.tensor(state.prompt_token_ids[start + 1:end + 1], device=logits.device)
            result[s.request_id] = position_logprobs(logits, targets, num, self.sampler.logprobs_mode)
            reported.append((state, end))
        return result, reported

    # ---- start-up measurements (the KV and swap pools are still empty) -----------------------------------------
    @torch.inference_mode()
    def measure_prefill_seconds_per_token(self, num_tokens: int) -> float:
        """Seconds per token of a prefill of `num_tokens` dummy tokens into the first blocks of the KV pool."""
        inputs = self._dummy_prefill(num_tokens)
        seconds = self._warm_run_seconds(
            lambda: self.forward(inputs.input_ids, inputs.positions, inputs.meta))
        return seconds / num_tokens

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, num_logit_rows: int) -> int:
        """vLLM's profile run, on a CUDA device before the KV pool exists: the peak memory of one maximal step
        over what was allocated before it. The step is a prefill of `num_tokens` dummy tokens into a temporary KV
        cache just large enough, then the logits of `num_logit_rows` rows."""
        assert self.device.type == "cuda" and self.kv is None, "profile before allocate_kv_cache(), on CUDA"
        self.allocate_kv_cache(-(-num_tokens // self.block_size) + 1)
        try:
            inputs = self._dummy_prefill(num_tokens)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)
            self.compute_logits(hidden[:num_logit_rows])
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - before
        finally:
            self.kv, self.kv_caches = None, []
            torch.cuda.empty_cache()

    def _dummy_prefill(self, num_tokens: int) -> ModelInputs:
        """Inputs of a prefill of `num_tokens` zeros into blocks 1, 2, ... of the KV pool."""
        block_ids = list(range(1, -(-num_tokens // self.block_size) + 1))
        return build_model_inputs([ScheduledRequest("measure", block_ids, 0, [0] * num_tokens, sample=False)],
                                  self.block_size, self.device)

    def measure_swap_seconds_per_block(self, num_blocks: int) -> float:
        """Seconds per block of copying blocks 1..num_blocks to the swap pool and back."""
        assert self.kv is not None and self.swap is not None
        kv, swap_kv, pairs = self.kv, self.swap.kv, [(i, i) for i in range(1, num_blocks + 1)]
        seconds = self._warm_run_seconds(
            lambda: (kv_tensors.swap_blocks(kv, swap_kv, pairs), kv_tensors.swap_blocks(swap_kv, kv, pairs)))
        return seconds / (2 * num_blocks)

    def _warm_run_seconds(self, run: Callable[[], object], repeats: int = 2) -> float:
        """Wall seconds of a call once warm: the first call pays one-off costs (first-touch page faults, a swap
        file's block allocation, lazy set-up) that a running engine has long paid; then the fastest of `repeats`
        calls, so that a moment's contention on a busy machine (another process taking the core) does not pass
        for the cost."""
        times = []
        for _ in range(1 + repeats):
            start = time.perf_counter()
            run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    def _add_request(self, new: NewRequestData) -> None:
        if new.request_id in self.requests:     # back after a preemption: the draft's K/V is gone with its blocks
            self.requests[new.request_id].num_draft_computed_tokens = 0
            return
        params = new.sampling_params
        grammar = None
        if params.structured_outputs is not None:
            assert self.structured_output is not None, "a structured-output request needs the runner's manager"
            grammar = self.structured_output.new_matcher(params.structured_outputs)
        self.requests[new.request_id] = CachedRequestState(new.request_id, list(new.prompt_token_ids), params,
                                                           self._generator(params.seed), grammar=grammar,
                                                           pooling=new.pooling_params, lora=new.lora_request,
                                                           token_type_ids=new.token_type_ids, images=new.images,
                                                           mrope=MRopeLayout.of(new.images),
                                                           thinking=_thinking(new.prompt_token_ids, params))

    def _start_token_bitmasks(self, request_ids: list[str]) -> tuple[list[str], Future] | None:
        """Start filling the bitmask of each constrained request about to sample, beside the forward pass:
        (their ids, the future [len(ids), ceil(V / 32)] bitmask); None when no request is constrained."""
        constrained = [r for r in request_ids if self.requests[r].grammar is not None and not self.requests[r].thinking]
        if not constrained:
            return None
        assert self.structured_output is not None
        return constrained, self.structured_output.fill_bitmask_async([self.requests[r].grammar for r in constrained])

    def _add_child(self, parent_id: str, child_id: str, index: int) -> None:
        """Sampling state for child `index` of a parallel-sampling request: its own seed stream."""
        parent = self.requests[parent_id]
        generator = self._generator(child_seed(parent.params.seed, index))
        grammar = parent.grammar.deep_copy() if parent.grammar is not None else None
        self.requests[child_id] = CachedRequestState(child_id, parent.prompt_token_ids, parent.params, generator,
                                                     list(parent.output_token_ids), grammar,
                                                     parent.num_prompt_logprob_positions, lora=parent.lora,
                                                     images=parent.images, image_rows=parent.image_rows,
                                                     mrope=parent.mrope, thinking=parent.thinking)

    def _generator(self, seed: int | None) -> torch.Generator | None:
        """A seeded request's own random stream; None draws from the engine's global one."""
        return make_generator(seed, self.device) if seed is not None else None

    def _fork_rows(self, request_ids: list[str], children: dict[str, list[str]]) -> tuple[list[int], list[str]]:
        """Repeat each forking request's logits row once per child: (row of each sample, its request id)."""
        rows, row_request_ids = [], []
        for row, request_id in enumerate(request_ids):
            rows.append(row)
            row_request_ids.append(request_id)
            for index, child_id in enumerate(children.get(request_id, ()), start=1):
                self._add_child(request_id, child_id, index)
                rows.append(row)
                row_request_ids.append(child_id)
        return rows, row_request_ids

    def _sample_all_but_embeddings(self, hidden: torch.Tensor, rows: torch.Tensor, request_ids: list[str],
                                   children: dict[str, list[str]], masks: dict[str, torch.Tensor]) -> RunnerOutput:
        """`_sample` for the generating requests among `request_ids` (each at its row of `hidden`, `rows` [n]); a
        pooling request's one token, which nobody sees, is token 0, without the LM head's product for its row (a
        [rows, vocab] product a step of short documents)."""
        keep = [i for i, request_id in enumerate(request_ids) if self.requests[request_id].pooling is None]
        output = RunnerOutput() if not keep else self._sample(
            hidden[rows[keep] if len(keep) < len(request_ids) else rows], [request_ids[i] for i in keep], children,
            masks)
        for request_id in request_ids:
            if self.requests[request_id].pooling is not None:
                self.requests[request_id].output_token_ids.append(0)
                output.sampled_token_ids[request_id] = 0
        return output

    def _sample(self, hidden: torch.Tensor, sample_request_ids: list[str], children: dict[str, list[str]],
                masks: dict[str, torch.Tensor]) -> RunnerOutput:
        """Sample one token per row of `hidden` ([num_sampled, H], the last row of each sampling request);
        `masks` holds the token bitmask of each constrained request (its children share it: their matchers are
        copies of the parent's, taken before this step's token)."""
        logits = self.compute_logits(hidden)                          # [num_sampled, vocab]
        parent_ids = sample_request_ids
        if children:
            rows, sample_request_ids = self._fork_rows(sample_request_ids, children)
            parent_ids = [parent_ids[row] for row in rows]
            logits = logits[torch.tensor(rows, device=logits.device)]       # [num_sampled + children, vocab]
        custom = self.sampler.custom
        if custom is not None:      # the rows in the order of the processors' batch indices
            order = custom.arrange(sample_request_ids, [(state.params, state.prompt_token_ids, state.output_token_ids)
                                                        for state in map(self.requests.get, sample_request_ids)])
            logits = logits[torch.tensor(order, device=logits.device)]
            sample_request_ids, parent_ids = [sample_request_ids[i] for i in order], [parent_ids[i] for i in order]
        states = [self.requests[request_id] for request_id in sample_request_ids]
        rows = [self._sampling_row(s, mask=masks.get(parent_id)) for s, parent_id in zip(states, parent_ids)]
        meta = SamplingMetadata.build(rows, self.shape.vocab_size, self.device, self.global_generator)
        result = self.sampler(logits, meta)
        token_ids = result.token_ids.tolist()
        _consume_in_grammars(states, token_ids)
        for state, token_id in zip(states, token_ids):
            state.output_token_ids.append(token_id)
        sampled = dict(zip(sample_request_ids, token_ids))
        logprobs = result.logprobs.to_lists(sample_request_ids) if result.logprobs is not None else {}
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sampling_row(self, state: CachedRequestState, draft_ids: list[int] | None = None,
                      mask: torch.Tensor | None = None) -> SamplingRow:
        """The sampler's view of a request, after its output tokens and then `draft_ids`, under its token
        bitmask (structured outputs), if any."""
        output_token_ids = state.output_token_ids + draft_ids if draft_ids else state.output_token_ids
        return SamplingRow(state.params, state.seen_prompt_token_ids, output_token_ids, state.generator,
                           self.eos_token_id, mask)

    def _sample_with_drafts(self, hidden: torch.Tensor, inputs: ModelInputs, children: dict[str, list[str]],
                            drafts: dict[str, list[int]], masks: dict[str, torch.Tensor]) -> RunnerOutput:
        """Sample the requests without drafts as usual; verify the others' drafts (pagedllm.spec_decode) on the
        logits of their last 1 + k rows (a constrained request gets no drafts). The drafts are verified before
        any request's state changes, so that a group that raised may run again."""
        last_rows = inputs.logits_indices.tolist()
        spec = [(row, r) for row, r in zip(last_rows, inputs.sample_request_ids) if r in drafts]
        request_ids = [r for _, r in spec]
        rows = [row - k for row, r in spec for k in range(len(drafts[r]), -1, -1)]
        logits = self.compute_logits(hidden[rows])                    # [sum(k + 1), vocab]
        states = [self.requests[r] for r in request_ids]
        sampling_rows = [self._sampling_row(s, drafts[r][:j]) for s, r in zip(states, request_ids)
                         for j in range(len(drafts[r]) + 1)]
        meta = SamplingMetadata.build(sampling_rows, self.shape.vocab_size, self.device, self.global_generator)
        verified = verify_drafts(logits, meta, request_ids, [drafts[r] for r in request_ids],
                                 self.sampler.logprobs_mode)
        plain = [(row, r) for row, r in zip(last_rows, inputs.sample_request_ids) if r not in drafts]
        output = self._sample_all_but_embeddings(hidden, torch.tensor([row for row, _ in plain], dtype=torch.long,
                                                                      device=hidden.device),
                                                 [r for _, r in plain], children, masks)
        for state, request_id, num_accepted, token_id in zip(states, request_ids, verified.num_accepted,
                                                             verified.token_ids):
            state.output_token_ids += drafts[request_id][:num_accepted] + [token_id]
            output.sampled_token_ids[request_id] = token_id
            output.num_accepted_draft_tokens[request_id] = num_accepted
        output.logprobs.update(verified.logprobs)
        return output

def _thinking(prompt_token_ids: list[int], params: SamplingParams) -> bool:
    """Whether a constrained request's reply opens in a thought its constraint waits out: it has `constrained_after`
    markers, and its prompt does not close a thought after the last it opened (a template that turns thinking off
    writes an empty one)."""
    if params.structured_outputs is None or params.constrained_after is None:
        return False
    start, end = params.constrained_after
    last_end = max((i for i, t in enumerate(prompt_token_ids) if t == end), default=-1)
    return last_end < 0 or last_end < max((i for i, t in enumerate(prompt_token_ids) if t == start), default=-1)


def _consume_in_grammars(states: list[CachedRequestState], token_ids: list[int]) -> None:
    """Advance each constrained request's matcher by its sampled token, all or none: when a grammar refuses its
    token (which its mask allowed), the matchers already advanced are rolled back before the error is raised, so
    that the group may run again (in parts) from the same state. A request still thinking consumes nothing; its
    thought's end marker starts its constraint from the next token."""
    advanced, thought_over = [], []
    for state, token_id in zip(states, token_ids):
        if state.grammar is None:
            continue
        if state.thinking:      # its constraint waits for the thought's end marker (`constrained_after`)
            if token_id == state.params.constrained_after[1]:
                thought_over.append(state)
            continue
        if not state.grammar.consume_token(token_id):
            for grammar in advanced:
                grammar.rollback(1)
            raise RuntimeError(f"request {state.request_id}: the grammar refused token {token_id}, which its "
                               f"mask allowed: {state.grammar.get_error()}")
        advanced.append(state.grammar)
    for state in thought_over:
        state.thinking = False


def _wait_token_bitmasks(pending: tuple[list[str], Future] | None) -> dict[str, torch.Tensor]:
    """Request id -> its row of the bitmask, once the fill started by _start_token_bitmasks is done."""
    if pending is None:
        return {}
    request_ids, future = pending
    return dict(zip(request_ids, future.result()))
