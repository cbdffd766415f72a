"""One rank's model execution: SchedulerOutput -> flat input batch -> forward -> sampling.

Tokens are laid out decodes first (one token each), then prefill chunks, which lets attention
batch all decodes in one call. Only rank 0 samples and returns tokens.

On GPU a decode-only step goes to the graph runner (static buffers, CUDA-graph replay when it
can, the same graph-safe forward eagerly when it cannot), and so does a step with prefill tokens
when a graph holds one row per token (workers/runner/cuda_graph.py, token rows); every other step, and
every step on CPU, takes the flat-batch path below. Both lay tokens out alike. On GPU the flat path
reads the paged cache in place as the graphs do (CudaBackend: decodes through the graphs' decode
kernel, chunks through varlen flash attention; workers/attention/gpu_paged.py): its decodes get
context lengths, its chunks a chunk table, and nothing gets a mask.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.attention.paged import AttentionMetadata, PrefillChunk
from workers.runner.cuda_graph import CudaGraphRunner, is_decode_only
from workers.runner.decode_inputs import DecodeBatch, decode_mask, make_decode_batch, padded_block_tables, slot_of
from workers.runner.input_batch import CachedRequestState, RequestStates
from workers.model.backend import TORCH, TorchBackend
from workers.model.decoder import DecoderForCausalLM
from workers.runner.prompt_logprobs import compute_prompt_logprobs, mark_scored, plan_prompt_logprobs
from workers.sampling.sampler import argmax_is_enough, sample
from workers.sampling.row import SamplingRow
from scheduler.math_utils import cdiv


@dataclass
class StepInputs:
    # Flat token ids of the step.
    input_ids: torch.Tensor
    # Their positions in their sequences.
    positions: torch.Tensor
    # Attention addressing.
    meta: AttentionMetadata
    # (request id, index of its last token in the batch) for requests that sample this step.
    samplers: list[tuple[str, int]]


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, stop_ids: tuple[int, ...],
                 graph_runner: CudaGraphRunner | None = None, backend: TorchBackend = TORCH) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # EOS ids of the model; masked (with each request's stop_token_ids) under min_tokens.
        self.stop_ids = stop_ids
        self.requests = RequestStates()
        self.is_first_rank = model.tp.is_first_rank
        # Decode-only steps on GPU (None on CPU).
        self.graph_runner = graph_runner
        # The model's backend (workers/model/backend.py): with the CPU kernels decodes get context
        # lengths instead of a mask, prefill chunks a chunk table (the prefill kernel reads it, or
        # the layer stack's SDPA), and the sampler takes the kernels' argmax.
        self.backend = backend

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        start = time.perf_counter()
        self.requests.update(out)
        if out.is_empty:
            return ModelRunnerOutput() if self.is_first_rank else None
        if self.graph_runner is not None and (
                is_decode_only(out.num_scheduled_tokens)
                or self.graph_runner.can_replay_rows(out.total_num_scheduled_tokens, self._prefill_context_reads(out))):
            hidden, samplers = self._run_rows(out)
        else:
            inputs = self.prepare_inputs(out)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            samplers = inputs.samplers
        result = self._sample(hidden, samplers, out.allowed_token_bitmasks)
        plan = plan_prompt_logprobs(out.num_scheduled_tokens, self.requests.states)
        if plan is not None:
            prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, plan)
            mark_scored(plan, self.requests.states)
            if result is not None and prompt_logprobs:
                result.prompt_logprobs = prompt_logprobs
        for req_id, num in out.num_scheduled_tokens.items():
            self.requests.states[req_id].num_computed_tokens += num
        if result is not None:
            result.forward_time = time.perf_counter() - start
        return result

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The flat batch of a step on the CPU path: decodes first (the shared decode layout),
        then prefill chunks."""
        states = self.requests.states
        decodes, prefills = [], []
        for req_id, num in out.num_scheduled_tokens.items():
            if num == 1:
                decodes.append(states[req_id])
            else:
                prefills.append((states[req_id], num))
        bs = self.block_size
        batch, samplers = self._decode_rows(decodes)
        input_ids, positions, slots = list(batch.token_ids), list(batch.positions), list(batch.slots)

        def add_tokens(state: CachedRequestState, num: int) -> None:
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start : start + num])
            for pos in range(start, start + num):
                positions.append(pos)
                slots.append(slot_of(state.block_ids, pos, bs))
            if start + num == len(state.token_ids):
                samplers.append((state.req_id, len(input_ids) - 1))

        decode_tables, decode_context_mask, decode_context_lens = self._decode_addressing(batch) if decodes else (
            None, None, None)

        chunks: list[PrefillChunk] = []
        for state, num in prefills:
            query_start = len(input_ids)
            add_tokens(state, num)
            context_len = state.num_computed_tokens + num
            mask = None
            # A chunk after cached context needs a causal mask with an offset for SDPA; the GPU
            # kernels read the chunk table instead (no [query_len, context_len] tensor per step).
            if state.num_computed_tokens > 0 and self.backend.dense_prefill_masks:
                q_pos = torch.arange(state.num_computed_tokens, context_len, device=self.device)
                mask = torch.arange(context_len, device=self.device)[None, :] <= q_pos[:, None]
            table = torch.tensor(state.block_ids[: cdiv(context_len, bs)], dtype=torch.long, device=self.device)
            chunks.append(PrefillChunk(query_start, num, context_len, table, mask))
        prefill_info, prefill_tables = self._chunk_table(prefills, chunks)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=len(decodes),
            decode_block_tables=decode_tables,
            decode_mask=decode_context_mask,
            prefills=chunks,
            decode_context_lens=decode_context_lens,
            prefill_chunk_info=prefill_info,
            prefill_block_tables=prefill_tables,
            prefill_kernel=self.backend.prefill_attention,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            samplers=samplers,
        )

    def _decode_addressing(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The decodes' block tables, and their context lengths (the decode kernel reads blocks in
        place) or a mask over the padded gather (torch's path)."""
        width = batch.max_num_blocks
        tables = torch.tensor(padded_block_tables(batch.block_tables, width), device=self.device)
        if self.backend.decode_context_lens:
            return tables, None, torch.tensor(batch.context_lens, dtype=torch.int32, device=self.device)
        return tables, decode_mask(torch.tensor(batch.context_lens, device=self.device), width * self.block_size), None

    def _chunk_table(self, prefills: list[tuple[CachedRequestState, int]], chunks: list[PrefillChunk]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(query_start, query_len, context_len) per chunk and their block tables, int32, for the
        backends that read them: the CPU prefill kernel and the CPU layer stack (which runs a step
        only with them: SDPA per chunk from C++ otherwise), the GPU varlen kernels."""
        if not (chunks and self.backend.prefill_chunk_table):
            return None, None
        info = torch.tensor([[c.query_start, c.query_len, c.context_len] for c in chunks], dtype=torch.int32,
                            device=self.device)
        rows = [state.block_ids[: cdiv(c.context_len, self.block_size)] for (state, _), c in zip(prefills, chunks)]
        tables = torch.tensor(padded_block_tables(rows, max(len(r) for r in rows)), dtype=torch.int32,
                              device=self.device)
        return info, tables

    def _prefill_context_reads(self, out: SchedulerOutput) -> int:
        """Context tokens the step's prefill tokens read as token rows (one at position p reads p + 1)."""
        reads = 0
        for req_id, num in out.num_scheduled_tokens.items():
            if num > 1:
                start = self.requests.states[req_id].num_computed_tokens
                reads += num * start + num * (num + 1) // 2
        return reads

    def _run_rows(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[tuple[str, int]]]:
        """A step through the graph runner, one decode-style row per scheduled token, in
        prepare_inputs' order (decodes, then each prefill chunk's tokens), so that hidden-state
        rows mean the same on both paths (prompt logprobs index them)."""
        states = self.requests.states
        decodes = [states[req_id] for req_id, num in out.num_scheduled_tokens.items() if num == 1]
        batch, samplers = self._decode_rows(decodes)
        bs = self.block_size
        for req_id, num in out.num_scheduled_tokens.items():
            if num == 1:
                continue
            state = states[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num
            blocks = state.block_ids
            batch.token_ids.extend(state.token_ids[start:end])
            batch.positions.extend(range(start, end))
            batch.slots.extend(slot_of(blocks, pos, bs) for pos in range(start, end))
            # Every row of the chunk shares one table, the chunk's: a row reads only the blocks of
            # its context_len, and one list object lets fill() write it once for all the rows.
            table = blocks[: cdiv(end, bs)]
            batch.block_tables.extend([table] * num)
            batch.context_lens.extend(range(start + 1, end + 1))
            if end == len(state.token_ids):
                samplers.append((req_id, batch.num_reqs - 1))
        return self.graph_runner.run(batch), samplers

    def _decode_rows(self, states: list[CachedRequestState]) -> tuple[DecodeBatch, list[tuple[str, int]]]:
        """The decode layout of these requests, and (request id, row) of those that sample: a
        one-token step that is not the last prompt token computes K/V only."""
        batch = make_decode_batch([(s.token_ids, s.block_ids, s.num_computed_tokens) for s in states],
                                  self.block_size)
        samplers = [(s.req_id, i) for i, s in enumerate(states) if s.num_computed_tokens + 1 == len(s.token_ids)]
        return batch, samplers

    def _sample(self, hidden: torch.Tensor, samplers: list[tuple[str, int]],
                bitmasks: dict[str, list[int]]) -> ModelRunnerOutput | None:
        if not samplers:
            # Every rank must still take part in the logits gather (collective).
            self.model.compute_logits(hidden[:0])
            return ModelRunnerOutput() if self.is_first_rank else None
        row_index = [i for _, i in samplers]
        if row_index == list(range(hidden.shape[0])):
            selected = hidden  # every row samples (decode steps): no gather
        else:
            # non_blocking: no host sync before the tokens are read (one .tolist() in sample()).
            selected = hidden[torch.tensor(row_index).to(self.device, non_blocking=True)]
        rows = []
        for req_id, _ in samplers:
            state = self.requests.states[req_id]
            rows.append(SamplingRow(
                params=state.params,
                prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
                output_token_ids=state.output_token_ids,
                stop_ids=self.stop_ids + state.params.stop_token_ids,
                generator=state.generator,
                allowed_token_bitmask=bitmasks.get(req_id),
            ))
        greedy_head = getattr(self.model, "greedy_lm_head", None)
        if greedy_head is not None and len(rows) <= greedy_head.max_rows and argmax_is_enough(rows):
            tokens = greedy_head.argmax(selected)
            if tokens is not None:
                result = ModelRunnerOutput()
                for (req_id, _), token_id in zip(samplers, tokens):
                    result.sampled_token_ids[req_id] = [token_id]
                return result
        logits = self.model.compute_logits(selected)
        if logits is None:
            return None
        sampled = sample(logits, rows, self.backend.row_max)
        result = ModelRunnerOutput()
        for n, ((req_id, _), token_id, lp) in enumerate(zip(samplers, sampled.token_ids, sampled.logprobs)):
            if token_id is None:
                # Only this request fails (the engine ends it); its batch mates go on.
                result.request_errors[req_id] = sampled.errors[n]
                continue
            result.sampled_token_ids[req_id] = [token_id]
            if lp is not None:
                result.logprobs[req_id] = [lp]
        return result
