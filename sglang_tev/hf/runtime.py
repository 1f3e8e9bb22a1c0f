"""The transformers runtime's generator: batched lossless tree speculative decoding over a static
KV cache (DESIGN §1, §3, §5). This module is the public API and its checks:
:class:`SpeculativeGenerator` (loading, ``generate`` / ``generate_batch``, argument checks, request
preparation, results); the rest of ``hf/`` does the decoding:

    scheduler.py      rows in batch slots (prefill, refill, retire), the cache and graphs it runs on
    round.py          one round: draft -> build -> tree forward -> verify (one host sync) -> commit
    masks.py          attention layout, prefill / tree masks, the kept tree mask
    stops.py          stop tokens, builder leaves, the cut of a block at stops and max_new_tokens
    control_state.py  per-slot state of penalties and logit bias
    target.py         the target model as the forwards call it
    records.py        Request, GenerationResult, RoundStats

Rows: every request has its own prompt length, sampling law, seed, stops, max_new_tokens and
controls. Each row draws its verifier uniforms from its own generator (seeded by its own seed), so
its law does not depend on its neighbours.

Host syncs: one per round (the packed decision), plus one per round for stage timings on CUDA
when ``time_stages`` is set (the benchmark sets it). On CPU everything is host memory anyway.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Callable, Sequence

import torch

from ..env import check_environment
from ..sampling import SamplingParams
from ..spec import (AUTO, DRAFT_MODES, GENERATION_METHODS, MAX_BUDGET, VERIFIERS, SpecError, check_budget,
                    greedy_temperature, resolve_draft_mode)
from .assets import shipped_pair_default
from .controls import Controls
from .records import STAGES, GenerationResult, Request, RoundStats, Row
from .round import NonFiniteLogitsError
from ..plan import AutoBudget, BudgetPolicy, FixedBudget, TreePlanner
from ..planner import ReachCalibration
from . import plan_cache as _plan_cache
from ..autobudget import DEFAULT_GRID, BudgetController
from ..costs import CostTable
from .scheduler import DecodeBuffers, Scheduler
from .static_cache import StaticKVCache, cache_kwargs  # noqa: F401 - cache_kwargs: tests and benchmarks import it from here
from .stops import stop_token_set
from .target import TargetModel

__all__ = ["SpeculativeGenerator", "GenerationResult", "RoundStats", "Request", "Controls",
           "GENERATION_METHODS", "DRAFT_MODES", "STAGES", "MAX_BUDGET", "NonFiniteLogitsError", "default_dtype"]

# GENERATION_METHODS and DRAFT_MODES are the spec's (sglang_tev.spec); what each draft mode runs
# here: ``marginal`` = per-depth draft logits (a DFlash2 drafter's transformed marginals) into
# DDTree, or the per-depth argmax chain for ``method="chain"``; ``lattice`` = the DFlash2
# selector's candidate lattice into the lattice DDTree (draft/lattice.build_lattice_tree), or the
# selector's own walk for ``method="chain"``.



def _quiet_cache_rename(fn):
    """transformers >= 5.2x renames ``past_key_values``;
    :func:`~sglang_tev.hf.static_cache.cache_kwarg_name` passes the new name when ``forward``
    declares it. A forward that hides it behind ``**kwargs`` still gets the
    old one, whose FutureWarning on every forward would break the CLI's one-line stderr contract."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*", category=FutureWarning)
            return fn(*args, **kwargs)

    return wrapper


def _one_call_at_a_time(fn):
    """Serialise calls on one generator: a call holds its cache, drafter buffers and
    ``committed`` / ``past_len`` from start to end, so other threads wait for the lock (HF
    pipelines and async servers share one generator). A call from inside a running call on the
    same thread (a stream callback) would wait for itself: it raises instead."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        me = threading.get_ident()
        if self._call_owner == me:
            raise RuntimeError("SpeculativeGenerator is busy: generate() was called from inside a running call on "
                               "this generator (a stream callback?); call it after that one returns")
        with self._call_lock:
            self._call_owner = me
            try:
                return fn(self, *args, **kwargs)
            finally:
                self._call_owner = None

    return wrapper


def _path_error(name: str, path) -> None:
    if path is None or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path, got {path!r}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{name}: no model directory at {os.fspath(path)!r}")


def default_dtype(target, device: torch.device) -> torch.dtype:
    """The weights dtype ``from_pretrained`` picks when given none.

    CUDA: bfloat16. CPU: the checkpoint's own half precision (``dtype`` / ``torch_dtype`` in the
    target's ``config.json``: bfloat16 or float16) as **bfloat16** when the CPU computes bf16
    natively (``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``; HF transformers and vLLM load
    a checkpoint in its own half precision too; an fp16 one runs as bf16 here, the CPU's native
    half type), else float32: without native bf16 every bf16 GEMM goes through
    conversions and a verify forward of 17 tokens costs ~4.8x one token against ~2x in float32
    (``docs/benchmarks.md``); with it, 1.3x against 1.6x, so trees pay more often. A float32
    checkpoint, a config without a dtype, or one that cannot be read: float32.

    Args:
        target: the target model directory.
        device: where the models go (a ``torch.device`` or its string).
    Returns a torch dtype. Raises nothing: a config transformers cannot read (or whose dtype it
    does not know) reads float32, and the loader then gives its own error."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu":
        return torch.float32
    from ..machine import cpu_bf16_flags

    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(target)
    except Exception:  # noqa: BLE001 - transformers raises several kinds for a bad config; the loader reports it
        return torch.float32
    stored = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if stored in (torch.bfloat16, torch.float16) and cpu_bf16_flags():
        return torch.bfloat16
    return torch.float32


def _is_prompt_list(prompt) -> bool:
    """A list of prompts (texts or id sequences), as opposed to one prompt of token ids."""
    if isinstance(prompt, (str, torch.Tensor)) or not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt)


class SpeculativeGenerator:
    """Tree speculative decoding over a transformers causal LM, batched.

    Args:
        target: an HF causal LM (Qwen2/3, Llama, Mistral, Gemma families: anything taking
            ``position_ids``, a 4-D ``attention_mask`` (or a dict of them per layer type) and a
            cache object with ``update``). Put in eval mode here.
        drafter: a :class:`~sglang_tev.hf.drafters.BatchDrafter`, a ``DFlashDrafter`` (run over
            a static context cache), a one-sequence :class:`~sglang_tev.hf.drafters.Drafter`
            (batch size 1 only), or None for autoregressive decoding only.
        tokenizer: optional HF tokenizer (text prompts, stop strings, EOS, decoded output).

    Attributes:
        time_stages: on CUDA, synchronise after each stage so ``RoundStats.stage_ms`` adds up
            (default False: one host sync per round). No effect on CPU.
        static_shapes: every tree forward of a (rows, nodes) pair has fixed shapes (the attention
            reads the whole static cache): what CUDA graphs need; runs eagerly anywhere.
        cuda_graphs: capture the tree forward per (rows, nodes) in a CUDA graph and replay it
            (implies static_shapes; CUDA only; a failed capture is logged and runs eagerly;
            ``graph_stats`` holds captures, capture seconds and fallbacks). Not measured here.
        graph_backend: with ``cuda_graphs``, the capture / replay backend (None: CUDA graphs,
            :class:`~sglang_tev.hf.cuda_graphs.CudaGraphBackend`). Tests pass
            ``sglang_tev.testing.graph_replay.EmulatedCudaGraphs`` to run the graphed path on CPU.
        committed, past_len: after a call with ONE prompt, its committed tokens (int64 [1, L]) and
            ``L - 1`` (the KV of positions [0, past_len) is in ``cache`` row 0); None after a batch.
            With several threads they describe whichever call finished last: use the result.

    Threads: one generator may be shared; its calls run one at a time (a lock: the others wait),
    each with the output it would have alone. A call from inside a running call on the same
    thread (a stream callback) raises ``RuntimeError`` ("busy"). For throughput, batch prompts
    in one call instead of calling from many threads.

    Raises:
        sglang_tev.env.EnvError (a ValueError): an ``SGLANG_TEV_*`` variable in the environment
        that sglang-tev does not know (``docs/env.md``; the closest known name is suggested).
        ValueError: a DFlash drafter that does not fit the target (hidden size, vocabulary,
        target_layer_ids, mask token); a target with attention layers the runtime cannot serve
        (layer types other than full and sliding attention); ``cuda_graphs`` on a non-CUDA target
        without a ``graph_backend``, or a ``graph_backend`` without ``cuda_graphs``.
    """

    def __init__(self, target, drafter=None, tokenizer=None, *, static_shapes: bool = False,
                 cuda_graphs: bool = False, graph_backend=None, cost_table=None,
                 plan_cache: bool | None = None) -> None:
        from .dflash_runner import StaticDFlashDrafter
        from .drafters import DFlashDrafter, SequenceDrafterAdapter

        check_environment()  # an unknown SGLANG_TEV_* name (a typo) is refused, not ignored
        self.target = target.eval()
        self.tokenizer = tokenizer
        self._target = TargetModel(self.target)  # cache keyword, attention layout, mask format, forward
        self.config = self._target.config
        self.device = self._target.device
        self.layout = self._target.layout
        model = getattr(drafter, "model", None)
        if model is not None and hasattr(model, "validate_against_target"):
            model.validate_against_target(self.config)
        if isinstance(drafter, DFlashDrafter):
            drafter = StaticDFlashDrafter(drafter.model, target)
        elif drafter is not None and not hasattr(drafter, "draft_rows"):
            drafter = SequenceDrafterAdapter(drafter)
        self.drafter = drafter
        self.time_stages = False
        if cuda_graphs and self.device.type != "cuda" and graph_backend is None:
            raise ValueError(f"cuda_graphs: needs the target on a CUDA device, it is on {self.device}")
        if graph_backend is not None and not cuda_graphs:
            raise ValueError("graph_backend: only used with cuda_graphs=True")
        self.static_shapes = bool(static_shapes)
        self.cuda_graphs = bool(cuda_graphs)
        # the KV cache and CUDA graphs, kept across calls
        self._buffers = DecodeBuffers(self.cuda_graphs, graph_backend)
        self.committed: torch.Tensor | None = None
        self.past_len: int | None = None
        self._call_lock = threading.Lock()
        self._call_owner: int | None = None
        # budget="auto": measured seconds per round by (batch, budget), kept across calls
        if cost_table is None:
            self.cost_table = CostTable()
        elif isinstance(cost_table, CostTable):
            self.cost_table = cost_table
        else:
            self.cost_table = CostTable.load(cost_table, frozen=True)
        self.budget_grid: tuple[int, ...] = DEFAULT_GRID
        self._controllers: dict = {}  # budget="auto": one BudgetController per target law
        self.calibration = ReachCalibration()  # budget="auto": draft score -> reach, per regime
        # budget="auto" cuts each round's trees to this round's draft (TreePlanner); False: one
        # budget per round from past rounds only (AutoBudget), for comparison
        self.adaptive_width = True
        # budget="auto" keeps what it learned across processes (hf/plan_cache.py); never into a
        # table the caller gave (a frozen one from `tune` must choose the same budgets)
        if plan_cache is None:
            plan_cache = _plan_cache.enabled()
        self.plan_cache = bool(plan_cache) and cost_table is None
        self._plan_store: _plan_cache.PlanCache | None = None
        self._saved_gains: dict = {}

    @classmethod
    @shipped_pair_default  # target None / "tiny-code": the shipped pair; no progress bars while loading
    def from_pretrained(
        cls,
        target: str | os.PathLike | None = None,
        draft: str | os.PathLike | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        **options,
    ) -> "SpeculativeGenerator":
        """Load a target (HF directory with tokenizer) and a z-lab DFlash drafter from disk.

        Args:
            target: directory of the target model and its tokenizer; None or ``"tiny-code"``: the
                pair shipped in the package (hf/assets.py), its drafter too unless ``draft`` is
                given (``draft=False``: none).
            draft: directory of the DFlash drafter (z-lab layout), or None.
            dtype: default :func:`default_dtype`: bfloat16 on CUDA; on CPU the checkpoint's half
                precision as bfloat16 where the CPU computes bf16 natively, else float32.
            device: default CUDA when available, else CPU.
            options: ``static_shapes`` / ``cuda_graphs`` (see the class).
        Raises:
            FileNotFoundError / ValueError naming ``target`` or ``draft``; ValueError when the
            drafter does not fit the target or ``target`` is a DFlash drafter directory;
            :class:`~sglang_tev.env.EnvError` for an unknown ``SGLANG_TEV_*`` variable.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..draft.dflash import DFlashDraftModel, is_dflash_checkpoint
        from .drafters import DFlashDrafter

        check_environment()  # before loading anything (the constructor checks again: cheap)
        _path_error("target", target)
        if draft is not None:
            _path_error("draft", draft)
        if is_dflash_checkpoint(target):
            raise ValueError(f"target: {os.fspath(target)!r} is a DFlash drafter (z-lab layout), not a target "
                             "model; pass it as the draft")
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if dtype is None:
            dtype = default_dtype(target, device)
        try:
            model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa")
        except (OSError, ValueError) as e:
            raise ValueError(f"target: cannot load a causal LM from {os.fspath(target)!r}: {e}") from e
        model.to(device)
        tok = None
        try:
            tok = AutoTokenizer.from_pretrained(target)
        except (OSError, ValueError):
            tok = None
        if tok is not None and len(tok) == 0:  # no tokenizer files: transformers returns an empty one
            tok = None
        drafter = None
        if draft is not None:
            dm = DFlashDraftModel.from_pretrained(draft, dtype=dtype, device=device)
            dm.validate_against_target(model.config)
            drafter = DFlashDrafter(dm.eval(), model)
        return cls(model, drafter, tok, **options)

    # ------------------------------------------------------------------ helpers
    @property
    def dtype_name(self) -> str:
        """The target's weights dtype as result files and cost tables record it (``"bfloat16"``)."""
        return str(self.target.dtype).removeprefix("torch.")

    @property
    def max_positions(self) -> int:
        return self._target.max_positions

    @property
    def vocab_size(self) -> int:
        return self._target.vocab_size

    @property
    def cache(self) -> StaticKVCache | None:
        """The static KV cache of the last call (None before the first)."""
        return self._buffers.cache

    @property
    def graph_stats(self) -> dict | None:
        """With ``cuda_graphs``: captures, capture seconds and fallbacks of the tree forwards (None
        before the first call, and without CUDA graphs)."""
        return None if self._buffers.graphs is None else self._buffers.graphs.stats

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        """Token ids of a text prompt; applies the tokenizer's chat template when it has one."""
        if self.tokenizer is None:
            raise ValueError("prompt: a text prompt needs a tokenizer; pass token ids instead")
        if chat_template and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    # ------------------------------------------------------------------ generation API
    @_quiet_cache_rename
    @torch.inference_mode()
    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor | Sequence[str | Sequence[int]],
        *,
        method: str = "tev",
        budget: int | str = "auto",
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        seed: int | Sequence[int] = 0,
        max_new_tokens: int | Sequence[int] = 256,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] | None = None,
        ignore_eos: bool = False,
        block_size: int | None = None,
        verifier: str = "tev",
        chat_template: bool = True,
        stream: Callable | None = None,
        batch_size: int | None = None,
        draft_mode: str = "auto",
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: dict | None = None,
        logits_processor: Callable | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate up to ``max_new_tokens`` tokens after ``prompt`` (or after each of several).

        Args:
            prompt: text (needs a tokenizer; chat template applied when ``chat_template`` and the
                tokenizer has one), token ids (list or int64 [L] / [1, L]), or a list of those
                (several prompts: a list of results comes back, in input order). A list of ints
                is ONE prompt of token ids.
            method: one of :data:`GENERATION_METHODS`.
            budget: DDTree budget B (non-root nodes), in [0, MAX_BUDGET], or ``"auto"`` (the default):
                each round's budget chosen from ``self.budget_grid`` (0 = a plain decoding round)
                to maximise expected tokens per second, from the exit law of past rounds and the
                measured seconds per round in ``self.cost_table`` (:mod:`sglang_tev.autobudget`).
                The output law is unchanged; seeded sampled output repeats run to run only with
                a fixed budget or a frozen cost table (``cost_table=`` of the constructor).
            sampling: the target law (default greedy: temperature 0); one, or one per prompt.
            seed: seed of the verifier's uniforms; one, or one per prompt.
            max_new_tokens: >= 1, never exceeded; one, or one per prompt.
            stop_token_ids: extra stop tokens; EOS is one unless ``ignore_eos``. The builder
                does not expand nodes below a stop token.
            stop_strings: the output is cut right after the token that completes one of them.
            block_size: K (default: the drafter's); a round drafts at most K - 1 depths.
            verifier: the verifier of ``chain`` (``tev`` / ``predraw`` / ``sequential`` / ``greedy``).
            stream: one prompt: called with each round's emitted token ids (after stop handling);
                several: called as ``stream(prompt_index, ids)``.
            batch_size: rows decoded together (default: all prompts); waiting prompts fill the
                slots of finished rows.
            draft_mode: one of :data:`DRAFT_MODES` (default ``"auto"``: the selector lattice for a
                DFlash2 drafter with a candidate selector, the per-depth marginals otherwise).
                With ``method="chain"``: ``lattice`` = DFlash2's selector chain, ``marginal`` = the
                per-depth argmax chain. Ignored by ``autoregressive``.
            repetition_penalty, frequency_penalty, presence_penalty, logit_bias,
            logits_processor: generation controls applied at every tree node with its own prefix
                (:mod:`sglang_tev.hf.controls`), so the output law is plain decoding's with them.

        Returns:
            :class:`GenerationResult`, or a list of them for a list of prompts. After a call with
            one prompt, ``self.committed`` / ``self.past_len`` / ``self.cache`` row 0 describe it.

        Raises:
            ValueError naming the argument: unknown method, verifier or draft_mode, ``draft_mode=
            "lattice"`` with a drafter that has no candidate selector, budget out of range,
            max_new_tokens < 1, an empty prompt or one longer than the position limit, block_size
            out of range, a speculative method without a drafter, invalid sampling values or
            controls, per-prompt lists of the wrong length, batch_size < 1.
            NonFiniteLogitsError: NaN / +inf target logits at a valid tree node (names the round,
            the prompt and the node).
            RuntimeError ("busy"): called from inside a running call on this generator (a stream
            callback). Calls from other threads wait for the running one instead.

        Exactness: every method's output has the law of plain sampling from the processed target
        law with the same controls (greedy: token-identical to plain greedy decoding), per row.
        """
        many = _is_prompt_list(prompt)
        prompts = list(prompt) if many else [prompt]
        n = len(prompts)
        if n == 0:
            raise ValueError("prompt: an empty list of prompts")

        def per(name, value, kind):
            if isinstance(value, (list, tuple)) and not isinstance(value, kind):
                if len(value) != n:
                    raise ValueError(f"{name}: {len(value)} values for {n} prompts")
                return list(value)
            return [value] * n

        samplings = per("sampling", sampling, SamplingParams)
        seeds = per("seed", seed, int)
        maxes = per("max_new_tokens", max_new_tokens, int)
        controls = Controls(repetition_penalty, frequency_penalty, presence_penalty, logit_bias, logits_processor)
        reqs = [Request(p, samplings[i], seeds[i], maxes[i], stop_token_ids, stop_strings, ignore_eos, controls)
                for i, p in enumerate(prompts)]
        wrapped = stream
        if stream is not None and not many:
            wrapped = lambda _i, ids: stream(ids)  # noqa: E731
        results = self.generate_batch(reqs, method=method, budget=budget, block_size=block_size, verifier=verifier,
                                      chat_template=chat_template, stream=wrapped, batch_size=batch_size,
                                      draft_mode=draft_mode)
        return results if many else results[0]

    @_one_call_at_a_time
    @_quiet_cache_rename
    @torch.inference_mode()
    def generate_batch(
        self,
        requests: Sequence[Request],
        *,
        method: str = "tev",
        budget: int | str = "auto",
        block_size: int | None = None,
        verifier: str = "tev",
        chat_template: bool = True,
        stream: Callable[[int, list[int]], None] | None = None,
        batch_size: int | None = None,
        draft_mode: str = "auto",
    ) -> list[GenerationResult]:
        """Decode several :class:`Request` s, each with its own settings, ``batch_size`` rows at a
        time; results in input order. Arguments and errors as :meth:`generate`."""
        if not requests:
            raise ValueError("requests: at least one Request is needed")
        K, vmethod = self._check_call(method, budget, block_size, verifier, requests, batch_size)
        mode = self.resolve_draft_mode(draft_mode, method)
        rows = self._prepare(requests, chat_template, vmethod)
        cap = min(len(rows), batch_size or len(rows))
        if self.drafter is not None and getattr(self.drafter, "max_rows", None) is not None:
            if cap > self.drafter.max_rows and method != "autoregressive":
                raise ValueError(f"batch_size: the drafter {type(getattr(self.drafter, 'inner', self.drafter)).__name__} "
                                 f"serves one sequence at a time; use batch_size=1 or a BatchDrafter")
        policy = self._budget_policy(budget, method, requests, K)
        Scheduler(self._target, self.drafter, self._buffers, rows, cap, method, vmethod,
                  policy, K, stream,
                  tokenizer=self.tokenizer, static=self.static_shapes or self.cuda_graphs,
                  time_stages=self.time_stages, draft_mode=mode).run()
        if isinstance(policy, TreePlanner):
            self._save_plan_cache()
        self._finish(rows, single=len(rows) == 1)
        return [r.result for r in rows]

    def _budget_policy(self, budget, method: str, requests, block_size: int | None) -> BudgetPolicy:
        """The call's :class:`~sglang_tev.plan.BudgetPolicy`: ``budget="auto"`` on a tree method
        -> :class:`~sglang_tev.plan.TreePlanner` over this target law's controller and the
        runtime's reach calibration (``self.calibration``); otherwise
        :class:`~sglang_tev.plan.FixedBudget` (for ``chain`` / ``autoregressive`` under auto, the
        controller's largest budget: only the buffers read it)."""
        if budget != AUTO:
            return FixedBudget(budget)
        self._load_plan_cache()
        ctl = self._budget_controller(requests)
        if method in ("chain", "autoregressive"):
            return FixedBudget(ctl.max_budget)
        if not self.adaptive_width:
            return AutoBudget(ctl, block_size)
        return TreePlanner(ctl, block_size, calibration=self.calibration)

    def _budget_controller(self, requests) -> BudgetController:
        """The ``budget="auto"`` controller of this target law (greedy, or the set of sampling
        temperatures), kept across calls with its learned gains; every controller reads
        ``self.cost_table``."""
        temps = sorted({0.0 if r.sampling is None else round(float(torch.as_tensor(r.sampling.temperature).reshape(-1)[0]), 3)
                        for r in requests})
        temps = [greedy_temperature(t) for t in temps]
        grid = tuple(sorted({int(b) for b in self.budget_grid if 0 <= int(b) <= MAX_BUDGET}))
        key = (grid, tuple(temps))
        ctl = self._controllers.get(key)
        if ctl is None or ctl.costs is not self.cost_table:
            ctl = self._controllers[key] = BudgetController(grid, self.cost_table)
            saved = self._saved_gains.get(_gains_name(key))
            if saved is not None:
                _plan_cache.restore_gains(ctl, saved)
        ctl.history = []
        return ctl

    # ------------------------------------------------------------------ the plan cache
    def _plan_key(self) -> dict:
        drafter = getattr(self.drafter, "model", None) or getattr(getattr(self.drafter, "inner", None), "model", None)
        return _plan_cache.cache_key(self.target, drafter, self._target.float_dtype, self.device)

    def _load_plan_cache(self) -> None:
        """Once per runtime, before the first ``budget="auto"`` call: what an earlier process
        learned with this key (:mod:`sglang_tev.hf.plan_cache`), unless off or a table was given."""
        if not self.plan_cache or self._plan_store is not None or self.cost_table.frozen:
            return
        self._plan_store = _plan_cache.PlanCache(self._plan_key())
        saved = self._plan_store.load()
        if saved is None or self.cost_table.seconds:  # this process already measured: keep its own
            return
        self.cost_table = saved["cost_table"]
        self.calibration = saved["calibration"]
        self._saved_gains = saved["gains"]
        self._controllers = {}

    def _save_plan_cache(self) -> None:
        if not self.plan_cache or self._plan_store is None or self.cost_table.frozen:
            return
        gains = dict(self._saved_gains)
        for key, ctl in self._controllers.items():
            if ctl.costs is self.cost_table:
                gains[_gains_name(key)] = _plan_cache.controller_gains(ctl)
        try:
            self._plan_store.save(self.cost_table, gains, self.calibration)
        except OSError as e:  # a read-only home must not fail the call that decoded fine
            _plan_cache.log.warning("plan cache not saved (%s: %s)", self._plan_store.path, e.strerror or e)

    # ------------------------------------------------------------------ argument checks
    @property
    def has_selector(self) -> bool:
        """The drafter has a DFlash2 candidate selector (``draft_mode="lattice"`` is available)."""
        return bool(getattr(self.drafter, "has_selector", False)) and hasattr(self.drafter, "draft_lattice_rows")

    def resolve_draft_mode(self, draft_mode: str = "auto", method: str = "tev") -> str | None:
        """The draft mode a call with these arguments runs: ``"lattice"`` or ``"marginal"``, None
        for ``autoregressive`` (no draft).

        Raises:
            SpecError naming ``draft_mode``: not one of :data:`~sglang_tev.spec.DRAFT_MODES`, or
            ``"lattice"`` with a drafter that has no candidate selector (DFlash v1, custom drafters).
        """
        mode = resolve_draft_mode(draft_mode, self.has_selector, lattice_error=(
            "'lattice' (the selector lattice tree, or the selector chain with method 'chain') needs a DFlash2 "
            "drafter with a candidate selector (config selector_rank / selector_top_k); this drafter has none: "
            "use draft_mode 'marginal' or 'auto'"))
        return None if method == "autoregressive" else mode

    def _check_call(self, method, budget, block_size, verifier, requests, batch_size):
        if method not in GENERATION_METHODS:
            raise SpecError("method", f"must be one of {GENERATION_METHODS}, got {method!r}")
        if verifier not in VERIFIERS:
            raise SpecError("verifier", f"must be one of {VERIFIERS}, got {verifier!r}")
        check_budget(budget)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise SpecError("batch_size", f"must be an int >= 1, got {batch_size!r}")
        vmethod = method if method in VERIFIERS else verifier
        speculative = method != "autoregressive"
        if speculative and self.drafter is None:
            raise ValueError(f"method {method!r} needs a drafter; load one or use method='autoregressive'")
        K = None
        if speculative:
            K = self.drafter.block_size if block_size is None else block_size
            if isinstance(K, bool) or not isinstance(K, int) or not 2 <= K <= self.drafter.block_size:
                raise SpecError("block_size", f"must be an int in [2, {self.drafter.block_size}], got {block_size!r}")
        for req in requests:
            m = req.max_new_tokens
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise SpecError("max_new_tokens", f"must be an int >= 1, got {m!r}")
            sp = SamplingParams(temperature=0.0) if req.sampling is None else req.sampling
            if not isinstance(sp, SamplingParams):
                raise SpecError("sampling", f"must be a SamplingParams, got {type(sp).__name__}")
            sp.validate(1)
            for name in ("temperature", "top_k", "top_p", "min_p"):
                if isinstance(getattr(sp, name), torch.Tensor) and getattr(sp, name).numel() != 1:
                    raise ValueError(f"sampling.{name}: one value per request (pass a list of SamplingParams)")
            if vmethod == "greedy" and not sp.all_greedy():
                raise SpecError("verifier", "'greedy' is exact only at temperature < 1e-5; use tev, predraw or sequential")
            if isinstance(req.seed, bool) or not isinstance(req.seed, int):
                raise SpecError("seed", f"must be an int, got {req.seed!r}")
            ss = req.stop_strings
            if ss is not None:
                if isinstance(ss, str) or not all(isinstance(s, str) and s for s in ss):
                    raise SpecError("stop_strings", "must be a list of non-empty strings")
                if self.tokenizer is None:
                    raise SpecError("stop_strings", "need a tokenizer")
            (req.controls or Controls()).validate(self.vocab_size)
        return K, vmethod

    def _prepare(self, requests, chat_template, vmethod) -> list[Row]:
        rows = []
        for i, req in enumerate(requests):
            p = req.prompt
            if isinstance(p, str):
                ids = self.encode(p, chat_template)
            elif isinstance(p, torch.Tensor):
                ids = p.reshape(-1).tolist()
            else:
                ids = [int(t) for t in p]
            if len(ids) == 0:
                raise SpecError("prompt", "must hold at least one token")
            if len(ids) > self.max_positions:
                raise SpecError("prompt", f"has {len(ids)} tokens, more than the model's {self.max_positions} positions")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise SpecError("prompt", f"token ids must be in [0, {self.vocab_size})")
            sp = SamplingParams(temperature=0.0) if req.sampling is None else req.sampling
            req = Request(ids, sp, req.seed, req.max_new_tokens, req.stop_token_ids, req.stop_strings, req.ignore_eos,
                          req.controls)
            greedy = sp.all_greedy()
            gen = None if greedy else torch.Generator(device=self.device).manual_seed(req.seed)
            stops = stop_token_set(req.stop_token_ids, req.ignore_eos, self.target, self.tokenizer)
            rows.append(Row(i, req, ids, stops, greedy, gen))
        return rows

    def _finish(self, rows: list[Row], single: bool) -> None:
        unknown: set[int] = set()
        ntok = None
        if self.tokenizer is not None and hasattr(self.tokenizer, "__len__"):
            ntok = len(self.tokenizer)
        for r in rows:
            res = r.result
            if self.tokenizer is not None:
                res.text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
                if ntok is not None:
                    res.unknown_token_ids = [t for t in res.token_ids if t >= ntok]
                unknown.update(res.unknown_token_ids)
        if unknown:
            warnings.warn(f"generated token ids {sorted(unknown)} are past the tokenizer ({ntok} tokens; the model has "
                          f"{self.vocab_size} rows): they are in token_ids and counted, but not in the text. The law "
                          "is exact (plain decoding would emit them too).", stacklevel=3)
        if single:
            r = rows[0]
            self.committed = torch.tensor([r.ids], dtype=torch.int64, device=self.device)
            self.past_len = r.past_len
        else:
            self.committed, self.past_len = None, None


def _gains_name(key) -> str:
    """A controller key ``(grid, temperatures)`` as the plan cache's name for its gains."""
    grid, temps = key
    return ",".join(map(str, grid)) + "|" + ",".join(f"{t:g}" for t in temps)
