"""EngineCore.step(): schedule -> propose -> verify -> update, synchronously.

Thread safety: `add_request` and `abort` may be called from another thread (the asyncio loop) while
`step` runs in a worker thread; they only enqueue into an inbox that `step` drains first.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid

import torch

from .builder import build_proposer, load_model, plan_kv_cache
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager
from .outputs import RequestOutput, TokenLogprob
from .proposer import ProposalRequest, Proposals
from .request import FinishReason, Request
from .runner import SequenceInput, forward_sequences
from .sampler import compute_logprobs
from .sampling_params import InvalidParameterError, SamplingParams
from .scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from .stats import EngineStats, RequestTiming
from .tokenizer import Tokenizer
from .verifier import Window, verify_windows

logger = logging.getLogger("specserve.engine")


class EngineCore:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        loaded = load_model(config.model, config.cache_dir)
        self.model, self.arch, self.model_directory = loaded.model, loaded.arch, loaded.directory
        self.device = config.model.device
        self.tokenizer = Tokenizer(loaded.directory, self.arch.eos_token_ids)
        self.max_length = min(
            config.max_length or self.arch.max_position_embeddings, self.arch.max_position_embeddings
        )
        default_budget = 2048 if config.enable_chunked_prefill else max(2048, self.max_length)
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_budget
        if not config.enable_chunked_prefill:
            # Without chunking a whole prompt must fit one step.
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_length)
        self.proposer = build_proposer(config, self.model, self.tokenizer)
        plan = plan_kv_cache(config, self.model, self.proposer, self.max_length, self.max_num_batched_tokens)
        self.num_blocks = plan.num_blocks
        num_slots = plan.num_blocks * config.block_size
        self.kv_cache = self.model.allocate_kv_cache(num_slots, config.model.dtype, self.device)
        if self.proposer is not None and hasattr(self.proposer, "bind_kv_cache"):
            self.proposer.bind_kv_cache(num_slots)
        self.kv_manager = KVCacheManager(plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_size=config.max_batch_size,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_length=self.max_length,
                num_speculative_tokens=config.num_speculative_tokens if self.proposer else 0,
                speculative_disable_batch_size=config.speculative_disable_batch_size,
            ),
            self.kv_manager,
        )
        self.stats = EngineStats()
        self.proposer_name = getattr(self.proposer, "name", "none") if self.proposer else "none"
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._token_times: dict[str, list[float]] = {}
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._pending_outputs: list[RequestOutput] = []
        self._last_hidden: dict[str, torch.Tensor] = {}

    # --- requests ------------------------------------------------------------------------------
    def make_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Validate and build a request (raises InvalidParameterError; nothing is queued)."""
        if not prompt_token_ids:
            raise InvalidParameterError("prompt", "the prompt is empty")
        if any(not 0 <= t < self.arch.vocab_size for t in prompt_token_ids):
            raise InvalidParameterError("prompt", "prompt token id outside the vocabulary")
        params.validate_for_vocab(self.arch.vocab_size)
        n = len(prompt_token_ids)
        if n >= self.max_length:
            raise InvalidParameterError(
                "prompt", f"the prompt has {n} tokens; this server's max length is {self.max_length}"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_length:
            raise InvalidParameterError(
                "max_tokens",
                f"max length is {self.max_length} tokens, but {n} prompt tokens + max_tokens"
                f" {params.max_tokens} = {n + params.max_tokens}",
            )
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )

    def add_request(self, request: Request) -> None:
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or not self._inbox.empty() or bool(self._pending_outputs)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            kind, item = self._inbox.get()
            if kind == "add":
                req = item  # type: ignore[assignment]
                assert isinstance(req, Request)
                self._requests[req.request_id] = req
                self._detok[req.request_id] = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, req.params.stop
                )
                seed = req.params.seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
                self._generators[req.request_id] = torch.Generator().manual_seed(seed % 2**63)
                self._token_times[req.request_id] = []
                self.scheduler.add_request(req)
            else:
                req = self._requests.get(str(item))
                if req is not None and not req.is_finished:
                    self._finish(req, FinishReason.ABORT)
                    self._pending_outputs.append(self._output(req, [], [], finished=True))

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._drain_inbox()
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            return outputs
        self.stats.num_steps += 1
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        proposals = self._propose(sched.scheduled)
        try:
            logits, hidden = self._verify_forward(sched.scheduled, proposals)
        except Exception as exc:  # a fault in the batch forward: fail those requests, keep serving
            logger.exception("model forward failed; failing %d requests", len(sched.scheduled))
            for s in sched.scheduled:
                self._finish(s.request, FinishReason.ERROR)
                outputs.append(self._output(s.request, [], [], finished=True, error=str(exc)))
            return outputs
        outputs += self._update(sched.scheduled, proposals, logits, hidden)
        return outputs

    def _propose(self, scheduled: list[ScheduledRequest]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        batch = [
            ProposalRequest(s.request, s.num_lookahead_tokens, self._last_hidden.get(s.request.request_id))
            for s in scheduled
            if s.num_lookahead_tokens > 0
        ]
        if not batch or self.proposer is None:
            return {}
        start = time.perf_counter()
        try:
            props: Proposals = self.proposer.propose(batch)
        except Exception:
            # A broken proposer costs speed, never correctness: this step decodes without drafts.
            logger.exception("proposer %s failed; decoding this step without drafts", self.proposer_name)
            self.stats.spec.proposer_errors += 1
            for p in batch:
                p.request.num_draft_computed_tokens = 0
            return {}
        finally:
            self.stats.spec.draft_seconds += time.perf_counter() - start
        result = {}
        for i, p in enumerate(batch):
            tokens = [int(t) for t in props.token_ids[i][: p.max_num_tokens]]
            probs = props.probs[i] if props.probs and i < len(props.probs) else None
            if tokens:
                result[p.request.request_id] = (tokens, probs[: len(tokens)] if probs is not None else None)
        return result

    def _verify_forward(
        self, scheduled: list[ScheduledRequest], proposals: dict[str, tuple[list[int], torch.Tensor | None]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = []
        for s in scheduled:
            req = s.request
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start : start + s.num_new_tokens]
            samples = start + s.num_new_tokens == req.num_tokens
            drafts = proposals.get(req.request_id, ([], None))[0]
            seqs.append(
                SequenceInput(tokens + drafts, start, req.block_ids, len(drafts) + 1 if samples else 0)
            )
        t0 = time.perf_counter()
        hidden = forward_sequences(self.model, self.kv_cache, seqs, self.config.block_size, self.device)
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden).cpu()  # [N, vocab]
        if proposals:
            self.stats.spec.verify_seconds += time.perf_counter() - t0
        return logits, hidden

    def _update(
        self,
        scheduled: list[ScheduledRequest],
        proposals: dict[str, tuple[list[int], torch.Tensor | None]],
        logits: torch.Tensor,
        hidden: torch.Tensor,
    ) -> list[RequestOutput]:
        windows: list[Window] = []
        rows: list[tuple[int, int]] = []  # (first logits row, number of rows) per window
        row = 0
        for s in scheduled:
            req = s.request
            sampling = req.num_computed_tokens + s.num_new_tokens == req.num_tokens
            req.num_computed_tokens += s.num_new_tokens
            if not sampling:
                self.kv_manager.cache_computed_blocks(req)
                continue
            drafts, probs = proposals.get(req.request_id, ([], None))
            windows.append(Window(req, drafts, probs, self._generators[req.request_id]))
            rows.append((row, len(drafts) + 1))
            row += len(drafts) + 1
        if not windows:
            return []
        emitted_all = verify_windows(logits, windows)
        outputs = []
        now = time.monotonic()
        for w, (first_row, _), emitted in zip(windows, rows, emitted_all, strict=True):
            req = w.request
            try:
                num_accepted = len(emitted) - 1
                if w.draft_token_ids:
                    req.spec.record(len(w.draft_token_ids), num_accepted)
                    self.stats.spec.record(len(w.draft_token_ids), num_accepted)
                    self.stats.events.acceptance_lengths.append(num_accepted + 1)
                # The KV of the accepted drafts is valid; the rest of the window is overwritten later.
                req.num_computed_tokens += num_accepted
                req.num_draft_computed_tokens = min(req.num_draft_computed_tokens, req.num_computed_tokens)
                if self.proposer is not None and self.proposer.needs_hidden_states:
                    self._last_hidden[req.request_id] = hidden[first_row + num_accepted].clone()
                kept, reason = self._append_tokens(req, emitted)
                logprobs = []
                if req.params.logprobs is not None:
                    lp = compute_logprobs(
                        logits[first_row : first_row + len(kept)], kept, req.params.logprobs
                    )
                    logprobs = [TokenLogprob(t, v, top) for t, (v, top) in zip(kept, lp, strict=True)]
                self._token_times[req.request_id] += [now] * len(kept)
                if req.first_token_time is None:
                    req.first_token_time = now
                self.stats.generation_tokens += len(kept)
                if reason is not None:
                    self._finish(req, reason)
                else:
                    self.kv_manager.cache_computed_blocks(req)
                outputs.append(self._output(req, kept, logprobs, finished=reason is not None))
            except Exception as exc:  # one request's fault stays in that request
                logger.exception("request %s failed in update", req.request_id)
                self._finish(req, FinishReason.ERROR)
                outputs.append(self._output(req, [], [], finished=True, error=str(exc)))
        return outputs

    def _append_tokens(self, req: Request, emitted: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append tokens one by one; a stop condition inside the window cuts it there."""
        detok = self._detok[req.request_id]
        kept: list[int] = []
        for token in emitted:
            req.output_token_ids.append(token)
            kept.append(token)
            if detok.add_token(token):
                return kept, FinishReason.STOP
            if token in req.params.stop_token_ids:
                return kept, FinishReason.STOP
            if not req.params.ignore_eos and token in req.eos_token_ids:
                return kept, FinishReason.STOP
            if req.max_new_tokens_left(self.max_length) <= 0:
                return kept, FinishReason.LENGTH
        return kept, None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        if self.proposer is not None and hasattr(self.proposer, "on_request_finished"):
            self.proposer.on_request_finished(req.request_id)
        self.stats.request_success[reason.value] += 1
        self.stats.prompt_tokens += len(req.prompt_token_ids)
        times = self._token_times.pop(req.request_id, [])
        now = time.monotonic()
        scheduled = req.first_scheduled_time or now
        self.stats.events.finished.append(
            RequestTiming(
                finish_reason=reason.value,
                queue_seconds=scheduled - req.arrival_time,
                ttft_seconds=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
                e2e_seconds=now - req.arrival_time,
                inter_token_seconds=[b - a for a, b in zip(times, times[1:], strict=False)],
                prompt_tokens=len(req.prompt_token_ids),
                generation_tokens=len(req.output_token_ids),
            )
        )
        self._generators.pop(req.request_id, None)
        self._last_hidden.pop(req.request_id, None)

    def _output(
        self,
        req: Request,
        new_ids: list[int],
        logprobs: list[TokenLogprob],
        finished: bool,
        error: str | None = None,
    ) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        text = detok.take_delta(finished) if detok else ""
        if finished:
            self._detok.pop(req.request_id, None)
            self._requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=finished,
            finish_reason=req.finish_reason.value if finished and req.finish_reason else None,
            new_logprobs=logprobs,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=len(req.output_token_ids),
            num_cached_prompt_tokens=req.num_cached_prompt_tokens,
            num_drafts=req.spec.num_drafts,
            num_draft_tokens=req.spec.num_draft_tokens,
            num_accepted_tokens=req.spec.num_accepted_tokens,
            accepted_per_position=list(req.spec.accepted_per_position),
            error=error,
        )
