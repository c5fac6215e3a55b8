"""EngineCore.step(): schedule -> propose -> forward -> verify -> commit, synchronously.

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
from .cost_profile import profile_forward_cost
from .detokenizer import IncrementalDetokenizer
from .grammar import MAX_FORCED_TOKENS, GrammarCompiler, GrammarMatcher
from .kv_cache_manager import KVCacheManager
from .memory import module_bytes
from .outputs import RequestOutput, TokenLogprob
from .proposal_check import check_proposal
from .proposer import ProposalRequest, Proposals
from .random_streams import RequestRandom
from .request import FinishReason, Request
from .runner import forward_sequences, padded_num_slots
from .sampler import compute_logprobs
from .sampling_params import InvalidParameterError, SamplingParams
from .scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from .spec_controller import Decision, Preview, SpeculationController
from .stats import EngineSnapshot, EngineStats, RequestTiming, StepRecord
from .step_batch import Draft, RequestState, VerificationWindow, WindowBatch
from .step_cost_model import DraftCostProfile, StepCostModel
from .step_log import StepLog
from .tokenizer import Tokenizer
from .verifier import Window, verify_windows

logger = logging.getLogger("specserve.engine")


class EngineCore:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        batch_invariant = config.batch_invariant and config.model.device.type == "cpu"
        if config.batch_invariant and not batch_invariant:  # asked for on CUDA
            logger.warning(
                "batch-invariant numerics are implemented for the CPU; %s uses SDPA", config.model.device
            )
        # Refused before any weight is read when the weights alone cannot fit the memory budget.
        loaded = load_model(
            config.model,
            config.cache_dir,
            batch_invariant=batch_invariant,
            memory_utilization=config.device_memory_utilization,
        )
        self.model, self.arch = loaded.model, loaded.arch
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
        num_slots = padded_num_slots(plan.num_blocks * config.block_size)
        self.kv_cache = self.model.allocate_kv_cache(num_slots, config.model.dtype, self.device)
        if self.proposer is not None and self.proposer.kv_bytes_per_token() > 0:
            self.proposer.bind_kv_cache(num_slots)
        # Cached KV is only reusable by the same weights, encoding and draft (whose KV shares the blocks).
        self.kv_manager = KVCacheManager(
            plan.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            cache_salt=repr((config.model, config.draft)),
        )
        assert config.num_speculative_tokens is not None  # resolved in EngineConfig.__post_init__
        self.controller = self._build_controller(config.num_speculative_tokens)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_size=config.max_batch_size,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_length=self.max_length,
                num_speculative_tokens=config.num_speculative_tokens if self.proposer else 0,
                speculative_disable_batch_size=config.speculative_disable_batch_size,
                speculative_policy=config.speculative_policy,
            ),
            self.kv_manager,
            self.controller,
            self._preview if self.proposer is not None else None,
        )
        self.stats = EngineStats()
        self.step_log = StepLog(config.step_log) if config.step_log else None
        self.proposer_name = self.proposer.name if self.proposer else "none"
        self._bad_proposal_logged = False
        self._bad_preview_logged = False
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._states: dict[str, RequestState] = {}  # every request added and not yet finished
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._pending_outputs: list[RequestOutput] = []
        # Built in the background now: a structured-output request is the first to need it.
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.arch.vocab_size, self.tokenizer.eos_token_ids)

    def _build_controller(self, k_max: int) -> SpeculationController | None:
        """The adaptive policy's controller, its cost curve profiled now (per-request policies can ask
        for adaptive on a static server too, so it exists whenever there is a proposer)."""
        if self.proposer is None or k_max == 0:
            return None
        max_rows = min(self.max_num_batched_tokens, self.config.max_batch_size * (k_max + 1))
        curve = profile_forward_cost(
            self.model, self.kv_cache, self.config.block_size, self.num_blocks, self.device, max_rows
        )
        ratio = self.proposer.step_weight_bytes() / max(1, module_bytes(self.model))
        return SpeculationController(
            k_max, StepCostModel(curve, draft_cost_ratio=ratio, draft_profile=self._profile_proposer())
        )

    def _profile_proposer(self) -> DraftCostProfile | None:
        """The proposer's own start-up timing (a plugin's: one that fails or returns something else is
        logged and priced by its weight bytes instead, as a proposer that times nothing)."""
        assert self.proposer is not None
        try:
            profile = self.proposer.profile_cost(self.config.max_batch_size)
        except Exception as exc:  # noqa: BLE001 - a plugin's fault costs its price, not the server
            logger.warning(
                "proposer %s: profile_cost failed (%s); drafts priced by weight bytes",
                self.proposer.name,
                exc,
            )
            return None
        if profile is not None and not isinstance(profile, DraftCostProfile):
            logger.warning(
                "proposer %s: profile_cost returned %s, not a DraftCostProfile; drafts priced by weight bytes",
                self.proposer.name,
                type(profile).__name__,
            )
            return None
        return profile

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
            # Compiled here so that a grammar the library rejects is the caller's error, not the step's.
            grammar=self.grammars.matcher(params.structured_output) if params.structured_output else None,
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
                req = item
                assert isinstance(req, Request)
                seed = req.params.seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
                self._states[req.request_id] = RequestState(
                    request=req,
                    detokenizer=IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.stop),
                    random=RequestRandom(seed),
                    grammar=req.grammar,
                )
                self.scheduler.add_request(req)
            else:
                state = self._states.get(str(item))
                if state is not None and not state.request.is_finished:
                    self._finish(state.request, FinishReason.ABORT)
                    self._pending_outputs.append(self._output(state.request, [], [], finished=True))

    # --- the step: schedule -> propose -> forward -> verify -> commit ---------------------------
    def step(self) -> list[RequestOutput]:
        self._drain_inbox()
        outputs, self._pending_outputs = self._pending_outputs, []
        step_start = time.perf_counter()
        sched = self.scheduler.schedule()
        self._on_preempted(sched.preempted)
        if sched.is_empty:
            return outputs
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        draft_start = time.perf_counter()
        drafts = self._propose(sched.scheduled, sched.speculation)
        draft_seconds = time.perf_counter() - draft_start
        window = self._windows_as_run(sched.scheduled, drafts, sched.speculation)
        self._record_k(sched.scheduled, window)
        all_hidden = self.proposer is not None and self.proposer.needs_all_hidden_states
        batch = WindowBatch.build(sched.scheduled, self._states, drafts, all_hidden)
        try:
            forward_start = time.perf_counter()
            logits, hidden, all_rows = self._forward(batch)
            forward_seconds = time.perf_counter() - forward_start
        except Exception as exc:  # a fault in the batch forward: fail those requests, keep serving
            logger.exception("model forward failed; failing %d requests", len(sched.scheduled))
            for s in sched.scheduled:
                outputs.append(self._fail(s.request, str(exc)))
            return outputs
        emitted = self._verify(batch, logits)
        outputs += self._commit(batch, emitted, logits, hidden, all_rows)
        step_seconds = time.perf_counter() - step_start
        self._observe_step(sched, batch, emitted, window, draft_seconds, forward_seconds, step_seconds)
        self.stats.bound_events()
        return outputs

    def _observe_step(
        self,
        sched: SchedulerOutput,
        batch: WindowBatch,
        emitted: list[list[int] | None],
        window: dict[str, int],
        draft_seconds: float,
        forward_seconds: float,
        step_seconds: float,
    ) -> None:
        """Feed the controller what this step cost, and record its choice against what happened
        (`window`: drafts per request as its window ran, `_windows_as_run`)."""
        decision = sched.speculation
        setup = decision.setup_tokens if decision is not None else 0  # catch-up tokens proposers fed
        num_seqs, num_tokens = len(batch.sequences), sum(len(q.token_ids) for q in batch.sequences)
        prefill_tokens = sum(s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)
        record = StepRecord(
            num_sequences=num_seqs,
            num_tokens=num_tokens,
            prefill_tokens=prefill_tokens,
            drafting=sum(1 for s in sched.scheduled if s.num_speculative_tokens > 0),
            draft_tokens=sum(window.values()),
            probes=len(decision.probed) if decision is not None else 0,
            setup_tokens=setup,
            emitted_tokens=sum(len(e) for e in emitted if e is not None),
            draft_seconds=draft_seconds,
            forward_seconds=forward_seconds,
            step_seconds=step_seconds,
            predicted_tokens=decision.predicted_tokens if decision is not None else None,
            predicted_seconds=decision.predicted_seconds if decision is not None else None,
            quiet=decision is not None and decision.quiet,
            headroom=decision.headroom if decision is not None else None,
            required_gain=decision.required_gain if decision is not None else None,
            gain_factor=decision.gain_factor if decision is not None else None,
            window_tokens=sum(s.num_speculative_tokens for s in sched.scheduled),
        )
        self.stats.events.steps.append(record)
        if self.step_log is not None:
            speculating = sum(1 for s in sched.scheduled if s.request.params.speculative_enabled)
            self.step_log.write(record, speculating)
        if self.controller is None:
            return
        cost = self.controller.cost
        free = decision.free if decision is not None else frozenset()
        # Requests whose drafts were free lookups (Preview.free) took no draft steps.
        drafting = [
            s for s in sched.scheduled if s.num_speculative_tokens > 0 and s.request.request_id not in free
        ]
        draft_steps = max((window[s.request.request_id] for s in drafting), default=0)
        # Priced before this step teaches the model. The step that ran, not the one the controller
        # weighed: that one had no requests admitted after its choice (their prefill chunks).
        predicted = cost.target_seconds(num_seqs, num_tokens, prefill_tokens)
        predicted_step = cost.step_seconds(num_seqs, num_tokens, len(drafting), draft_steps, prefill_tokens)
        self.stats.events.forward_costs.append((num_seqs, num_tokens, predicted, forward_seconds))
        cost.observe_target(num_seqs, num_tokens, forward_seconds, prefill_tokens)
        probed = set(decision.probed) if decision is not None else set()
        probe_only = bool(drafting) and all(s.request.request_id in probed for s in drafting)
        if probe_only:
            # Only probes drafted: priced on their own (a probe may first catch up on missed tokens).
            cost.observe_probe(len(drafting), draft_seconds, setup)
        elif drafting:
            cost.observe_draft(len(drafting), draft_steps, draft_seconds, setup)
        cost.observe_overhead(step_seconds - forward_seconds - draft_seconds)
        if decision is None:
            return
        k = decision.k
        controlled_tokens = sum(
            len(e)
            for w, e in zip(batch.windows, emitted, strict=True)
            if e is not None and w.state.request.request_id in k
        )
        decode_only = all(s.num_new_tokens == 1 and s.request.request_id in k for s in sched.scheduled)
        if decode_only and not probe_only and not decision.static_drafts:
            # Every scheduled request is in k here, so its tokens are all the step emitted.
            drafted = any(s.num_speculative_tokens > 0 for s in sched.scheduled)
            self.controller.observe_step(num_seqs, drafted, controlled_tokens, step_seconds, decision.promise)
        spec = self.stats.spec
        spec.controller_steps += 1
        spec.quiet_steps += decision.quiet
        spec.predicted_tokens += decision.predicted_tokens
        spec.predicted_step_seconds += predicted_step
        spec.measured_step_seconds += step_seconds
        spec.measured_tokens += controlled_tokens

    @staticmethod
    def _windows_as_run(
        scheduled: list[ScheduledRequest], drafts: dict[str, Draft], decision: Decision | None
    ) -> dict[str, int]:
        """Drafts per scheduled request as its window ran: its k, or the drafts of a window its
        proposer ended where unsure (Decision.stop_below), which took that many draft steps."""
        stop_below = decision.stop_below if decision is not None else {}
        window = {}
        for s in scheduled:
            rid, k = s.request.request_id, s.num_speculative_tokens
            if rid in stop_below:
                k = min(k, len(drafts[rid].token_ids) if rid in drafts else 0)
            window[rid] = k
        return window

    def _record_k(self, scheduled: list[ScheduledRequest], window: dict[str, int]) -> None:
        """The k each decoding request got this step (per request for usage, per step for the
        histogram): its window as run (`_windows_as_run`)."""
        if self.proposer is None:
            return
        for s in scheduled:
            if s.request.in_decode:
                k = window[s.request.request_id]
                s.request.spec.record_k(k)
                self.stats.spec.record_k(k)
                self.stats.events.chosen_k.append(k)

    def _on_preempted(self, preempted: list[Request]) -> None:
        self.stats.num_preemptions += len(preempted)
        if self.proposer is not None:
            for req in preempted:
                self.proposer.on_preempted(req)

    def _propose(self, scheduled: list[ScheduledRequest], decision: Decision | None) -> dict[str, Draft]:
        """Drafts per request id, validated; requests that get none are absent."""
        if self.proposer is None:
            return {}
        stop_below = decision.stop_below if decision is not None else {}
        with_hidden = self.proposer.needs_hidden_states
        forced: dict[str, Draft] = {}  # windows the grammar fills on its own: no proposer call
        batch = []
        for s in scheduled:
            if s.num_speculative_tokens <= 0:
                continue
            state = self._states[s.request.request_id]
            if state.grammar is not None and state.forced_next:
                tokens = state.forced_next[: s.num_speculative_tokens]
                forced[s.request.request_id] = Draft(tokens, None, num_forced=len(tokens))
                continue
            batch.append(
                ProposalRequest(
                    s.request,
                    s.num_speculative_tokens,
                    state.last_hidden if with_hidden else None,
                    state.random,
                    stop_below.get(s.request.request_id, 0.0),
                )
            )
        drafts = self._proposer_drafts(batch)
        for p in batch:
            state = self._states[p.request.request_id]
            if state.grammar is not None and p.request.request_id in drafts:
                drafts[p.request.request_id] = self._constrain(
                    state.grammar, drafts[p.request.request_id], p.num_speculative_tokens
                )
        drafts.update(forced)
        return {rid: d for rid, d in drafts.items() if d.token_ids}

    @staticmethod
    def _constrain(grammar: GrammarMatcher, draft: Draft, k: int) -> Draft:
        """Cut a proposal before the first token the grammar forbids (it would be rejected for
        certain: verifying it would waste a row), then fill the window with forced tokens.

        A cut draft drawn from a real q keeps (token, q) so that the verifier decides that position
        as the rejection would have; a one-hot draft needs nothing (its rejection draws from p)."""
        n = grammar.valid_prefix(draft.token_ids)
        tokens, probs = draft.token_ids[:n], draft.probs[:n] if draft.probs is not None else None
        cut = None
        if n < len(draft.token_ids) and draft.probs is not None:
            q = draft.probs[n]  # [V]
            if float(q[draft.token_ids[n]]) < 1.0:
                cut = (draft.token_ids[n], q)
        if cut is not None:  # the forced token must not replace a residual draw (it is not one-hot p)
            return Draft(tokens, probs, cut=cut)
        extra = grammar.forced_after(tokens, min(k - n, MAX_FORCED_TOKENS))
        if extra and probs is not None:
            width = max(probs.shape[-1], max(extra) + 1)
            probs = torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))
            one_hot = torch.nn.functional.one_hot(torch.tensor(extra), width).to(probs.dtype)
            probs = torch.cat([probs, one_hot])  # [n + len(extra), V]
        return Draft(tokens + extra, probs, num_forced=len(extra))

    def _preview(self, request: Request, max_drafts: int) -> Preview | None:
        """The proposer's free look ahead for the controller; a broken one is ignored (and counted)."""
        assert self.proposer is not None
        try:
            seen = self.proposer.preview(request, max_drafts)
        except Exception:
            self.stats.spec.proposer_errors += 1
            if not self._bad_preview_logged:  # it would fail every step: once is enough
                self._bad_preview_logged = True
                logger.exception(
                    "proposer %s preview failed; the controller goes without it (counted in"
                    " spec_decode_proposer_errors, logged once)",
                    self.proposer_name,
                )
            return None
        if seen is None:
            return None
        if (
            not isinstance(seen, Preview)
            or not isinstance(seen.max_drafts, int)
            or not isinstance(seen.hint, int)
            or not isinstance(seen.free, bool)
            or not isinstance(seen.setup_tokens, int)
            or not isinstance(seen.stops_unsure, bool)
        ):
            self._reject_proposal(
                f"preview {seen!r} is not a Preview(max_drafts: int, hint: int, drafts, free: bool,"
                " setup_tokens: int, stops_unsure: bool)"
            )
            return None
        return seen

    def _proposer_drafts(self, batch: list[ProposalRequest]) -> dict[str, Draft]:
        """The proposer's drafts for `batch`, validated; requests that get none are absent."""
        if not batch or self.proposer is None:
            return {}
        start = time.perf_counter()
        try:
            props: Proposals = self.proposer.propose(batch)
        except Exception:
            # A broken proposer costs speed, never correctness: this step decodes without drafts.
            logger.exception("proposer %s failed; decoding this step without drafts", self.proposer_name)
            self.stats.spec.proposer_errors += 1
            return {}
        finally:
            self.stats.spec.draft_seconds += time.perf_counter() - start
        if len(props.token_ids) != len(batch) or (props.probs and len(props.probs) != len(batch)):
            self._reject_proposal(f"{len(props.token_ids)} proposals for a batch of {len(batch)} requests")
            return {}
        drafts = {}
        for i, p in enumerate(batch):
            tokens = list(props.token_ids[i][: p.num_speculative_tokens])
            probs = props.probs[i] if props.probs else None
            problem = check_proposal(tokens, probs, self.arch.vocab_size)
            if problem is not None:
                self._reject_proposal(problem)
            elif tokens:
                drafts[p.request.request_id] = Draft(
                    tokens, probs[: len(tokens)] if probs is not None else None
                )
        return drafts

    def _reject_proposal(self, problem: str) -> None:
        """A malformed proposal: its request decodes plainly this step. Logged once per proposer."""
        self.stats.spec.proposer_errors += 1
        if not self._bad_proposal_logged:
            self._bad_proposal_logged = True
            logger.error(
                "proposer %s returned an invalid proposal (%s); those requests decode without drafts"
                " (counted in spec_decode_proposer_errors, logged once)",
                self.proposer_name,
                problem,
            )

    def _forward(self, batch: WindowBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run the target over every scheduled request: logits and hidden states of the window rows,
        and (for a proposer with needs_all_hidden_states) the hidden state of every fed token."""
        t0 = time.perf_counter()
        hidden = forward_sequences(
            self.model, self.kv_cache, batch.sequences, self.config.block_size, self.device
        )
        all_rows = None
        if batch.window_rows is not None:
            all_rows, hidden = hidden, hidden.index_select(0, batch.window_rows.to(hidden.device))
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden).cpu()  # [batch.num_rows, vocab]
        if any(w.draft.token_ids for w in batch.windows):
            self.stats.spec.verify_seconds += time.perf_counter() - t0
        return logits, hidden, all_rows  # [N, vocab], [N, hidden], [fed tokens, hidden] or None

    def _verify(self, batch: WindowBatch, logits: torch.Tensor) -> list[list[int] | None]:
        """Emitted tokens per window (accepted drafts + one recovered or bonus token); None for a
        window whose logits are not finite (a numerical fault in that request: it alone fails)."""
        # A row is finite iff its sum is (logits are far below float32's range): one read of [N, V].
        # One list read back, not a tensor index and a read back per window: verification's host time
        # at 16 SmolLM2 sequences on the EPYC VM went from 0.57-0.61 to 0.50-0.52 ms a step.
        finite_rows = torch.isfinite(logits.sum(dim=-1)).tolist()  # [N]
        good = [w for w in batch.windows if all(finite_rows[w.rows])]
        if not good:
            return [None] * len(batch.windows)
        if len(good) < len(batch.windows):
            logits = torch.cat([logits[w.rows] for w in good])  # the verifier wants window-ordered rows
        emitted = verify_windows(
            logits,
            [
                Window(
                    w.state.request,
                    w.draft.token_ids,
                    w.draft.probs,
                    w.state.random,
                    allowed=self._grammar_masks(w) if w.state.grammar is not None else None,
                    cut_draft=w.draft.cut,
                )
                for w in good
            ],
        )
        by_window = {id(w): e for w, e in zip(good, emitted, strict=True)}
        return [by_window.get(id(w)) for w in batch.windows]

    def _grammar_masks(self, w: VerificationWindow) -> torch.Tensor:
        """[k + 1, V] bool. A position where the grammar admits nothing (a dead end) admits EOS
        instead, so the row stays a distribution and the request stops there (_commit_window)."""
        grammar = w.state.grammar
        assert grammar is not None
        masks = grammar.window_masks(w.draft.token_ids)
        if grammar.is_dead:
            masks[:] = False
        empty = ~masks.any(dim=-1)  # [k + 1]
        if (grammar.is_dead or bool(empty.any())) and not grammar.dead_end_logged:
            grammar.dead_end_logged = True
            logger.warning(
                "request %s: the grammar admits no continuation (%s); finishing with stop",
                w.state.request.request_id,
                grammar.error.splitlines()[0] if grammar.error else "dead end",
            )
        if bool(empty.any()):
            eos = torch.tensor(sorted(self.tokenizer.eos_token_ids), dtype=torch.long)
            masks[empty.nonzero().squeeze(1).unsqueeze(1), eos.unsqueeze(0)] = True
        return masks

    def _commit(
        self,
        batch: WindowBatch,
        emitted_all: list[list[int] | None],
        logits: torch.Tensor,  # [N, vocab]
        hidden: torch.Tensor,  # [N, hidden]
        all_rows: torch.Tensor | None = None,  # [fed tokens, hidden]: see WindowBatch.hidden_starts
    ) -> list[RequestOutput]:
        """Advance every scheduled request; append the emitted tokens of those that sampled."""
        for i, s in enumerate(batch.scheduled):
            req = s.request
            start = req.num_computed_tokens
            req.num_computed_tokens += s.num_new_tokens
            if req.num_computed_tokens < req.num_tokens:  # a prefill chunk that samples nothing
                self.kv_manager.cache_computed_blocks(req)
                if all_rows is not None and batch.hidden_starts is not None and self.proposer is not None:
                    first = batch.hidden_starts[i]
                    self.proposer.on_hidden_states(
                        req, start, all_rows[first : first + s.num_new_tokens].clone()
                    )
        outputs = []
        now = time.monotonic()
        for w, emitted in zip(batch.windows, emitted_all, strict=True):
            req = w.state.request
            if emitted is None:
                logger.error("request %s: non-finite logits; failing it alone", req.request_id)
                self.stats.nonfinite_logits_requests += 1
                outputs.append(self._fail(req, "non-finite logits (NaN or inf) in this request's forward"))
                continue
            try:
                outputs.append(self._commit_window(w, emitted, logits, hidden, now, all_rows))
            except Exception as exc:  # one request's fault stays in that request
                logger.exception("request %s failed in update", req.request_id)
                outputs.append(self._fail(req, str(exc)))
        return outputs

    def _commit_window(
        self,
        w: VerificationWindow,
        emitted: list[int],
        logits: torch.Tensor,  # [N, vocab]
        hidden: torch.Tensor,  # [N, hidden]
        now: float,
        all_rows: torch.Tensor | None = None,  # [fed tokens, hidden]
    ) -> RequestOutput:
        state, req = w.state, w.state.request
        num_drafts, num_accepted = len(w.draft.token_ids), len(emitted) - 1
        # The proposer and the controller learn from the proposer's own drafts, not the grammar's.
        num_proposed = w.draft.num_proposed
        accepted_proposed = min(num_accepted, num_proposed)
        if self.controller is not None:
            self.controller.observe_verification(req.request_id, num_proposed, accepted_proposed, emitted)
        if num_drafts:
            req.spec.record(num_drafts, num_accepted)
            self.stats.spec.record(num_drafts, num_accepted)
            self.stats.events.acceptance_lengths.append(num_accepted + 1)
            forced_accepted = max(0, num_accepted - num_proposed)
            req.spec.num_forced_tokens += forced_accepted
            self.stats.spec.num_forced_tokens += forced_accepted
        # The KV of the accepted drafts is valid; the rest of the window is overwritten later.
        req.num_computed_tokens += num_accepted
        if self.proposer is not None:
            if all_rows is not None:  # every verified position: the fed tokens and accepted drafts
                verified = w.num_new_tokens + num_accepted
                self.proposer.on_hidden_states(
                    req,
                    req.num_computed_tokens - verified,
                    all_rows[w.hidden_row : w.hidden_row + verified].clone(),
                )
            self.proposer.on_accepted(req, accepted_proposed)
            if self.proposer.needs_hidden_states:
                state.last_hidden = hidden[w.first_row + num_accepted].clone()
        kept, reason = self._append_tokens(state, emitted)
        if state.grammar is not None and reason is None and self._may_speculate(req):
            state.forced_next = state.grammar.forced_after([], MAX_FORCED_TOKENS)
            req.num_forced_tokens = len(state.forced_next)
        logprobs = []
        if req.params.logprobs is not None:
            lp = compute_logprobs(logits[w.first_row : w.first_row + len(kept)], kept, req.params.logprobs)
            logprobs = [TokenLogprob(t, v, top) for t, (v, top) in zip(kept, lp, strict=True)]
        state.token_times += [now] * len(kept)
        if req.first_token_time is None:
            req.first_token_time = now
        self.stats.generation_tokens += len(kept)
        if reason is not None:
            self._finish(req, reason)
        else:
            self.kv_manager.cache_computed_blocks(req)
        return self._output(req, kept, logprobs, finished=reason is not None)

    def _may_speculate(self, req: Request) -> bool:
        """Forced tokens are drafts: only worth computing when this request can get draft slots."""
        return (
            self.proposer is not None
            and req.params.speculative_enabled
            and (req.params.num_speculative_tokens != 0)
        )

    @staticmethod
    def _grammar_stops(state: RequestState, token: int) -> bool:
        """Consume one emitted token. True when the structured output is complete (only EOS is left:
        stop here, in every decoding mode alike) or the grammar can go no further (a dead end)."""
        grammar = state.grammar
        assert grammar is not None
        accepted = grammar.commit([token])
        if not accepted or grammar.is_dead:
            logger.warning(
                "request %s: the grammar admits no continuation (%s); finishing with stop",
                state.request.request_id,
                grammar.error.splitlines()[0] if grammar.error else "dead end",
            )
            return True
        return grammar.is_finished

    def _append_tokens(
        self, state: RequestState, emitted: list[int]
    ) -> tuple[list[int], FinishReason | None]:
        """Append tokens one by one; a stop condition inside the window cuts it there."""
        req, detok = state.request, state.detokenizer
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
            if state.grammar is not None and self._grammar_stops(state, token):
                return kept, FinishReason.STOP
            if req.max_new_tokens_left(self.max_length) <= 0:
                return kept, FinishReason.LENGTH
        return kept, None

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """Finish one request with an error its client sees; the rest of the batch carries on."""
        self._finish(req, FinishReason.ERROR)
        return self._output(req, [], [], finished=True, error=error)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Release the request everywhere; its state goes once its last output is built (_output)."""
        self.scheduler.finish(req, reason)
        if self.proposer is not None:
            self.proposer.on_finished(req)
        if self.controller is not None:
            self.controller.forget(req.request_id)
        self.stats.request_success[reason.value] += 1
        self.stats.prompt_tokens += len(req.prompt_token_ids)
        state = self._states.get(req.request_id)
        if state is not None and state.grammar is not None:
            self.stats.spec.grammar_seconds += state.grammar.seconds
        times = state.token_times if state else []
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

    def _output(
        self,
        req: Request,
        new_ids: list[int],
        logprobs: list[TokenLogprob],
        finished: bool,
        error: str | None = None,
    ) -> RequestOutput:
        state = self._states.pop(req.request_id, None) if finished else self._states.get(req.request_id)
        text = state.detokenizer.take_delta(finished) if state else ""
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
            num_forced_tokens=req.spec.num_forced_tokens,
            num_k_decisions=req.spec.num_k_decisions,
            sum_k=req.spec.sum_k,
            error=error,
        )

    def snapshot(self) -> EngineSnapshot:
        """Counters, gauges and configuration for the metrics exporter, draining the per-step events.

        Runs on the event loop while a step may run in the worker thread: see EngineStats.snapshot.
        """
        pool = self.kv_manager.pool
        return self.stats.snapshot(
            prefix_cache_queries=pool.num_queries,
            prefix_cache_hits=pool.num_hits,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=pool.usage(),
            num_speculative_tokens=self.scheduler.config.num_speculative_tokens,
            block_size=self.config.block_size,
            num_blocks=self.num_blocks,
            device_memory_utilization=self.config.device_memory_utilization,
            proposer_name=self.proposer_name,
        )
