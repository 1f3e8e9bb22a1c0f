"""The transformers runtime: lossless tree speculative decoding for one sequence.

One round (DESIGN §1, §3, §5)::

    draft    drafter(committed context, root) -> per-depth logits [1, H, V]
    build    build_ddtree (or a chain, or nothing for autoregressive) -> DraftTree, N = 1 + B
    forward  one target forward over the N tree nodes: tree attention mask, positions
             past_len + depth, KV appended to the cache
    verify   verify_tree -> accepted path (root first) + bonus token
    commit   move the accepted nodes' KV rows to the front of the tree window and crop
             (no re-forward); the accepted nodes' target features become the drafter's new context

The root of a round is the last committed token: it has no KV yet and is fed with the tree, so the
prefill covers the prompt minus its last token and every new token comes out of a verify step.
``past_len`` counts the tokens whose KV is cached; node v sits at position ``past_len + depth(v)``.

One sequence per generator (the core is batched; a batched runtime comes with the GPU fast path).
The KV cache is a transformers ``DynamicCache`` on every device.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..draft.ddtree import build_ddtree
from ..sampling import SamplingParams
from ..tree import DraftTree, tree_attention_mask
from ..verify import METHODS as VERIFIERS
from ..verify import verify_tree
from .assets import shipped_pair_default

__all__ = ["SpeculativeGenerator", "GenerationResult", "RoundStats", "GENERATION_METHODS", "STAGES", "MAX_BUDGET"]

GENERATION_METHODS = ("autoregressive", "chain", "tev", "predraw", "sequential", "greedy")
"""``autoregressive``: plain decoding (a root-only tree per step); ``chain``: the linear DFlash
block (per-depth argmax, parents[i] = i - 1) checked by ``verifier``; the rest: DDTree verified by
that method."""

STAGES = ("draft", "build", "tree_forward", "verify", "commit")

MAX_BUDGET = 1024
"""Largest DDTree budget the runtime accepts (the largest the DDTree reference benchmarks): the
builder's memory grows as budget x min(budget, V)."""


@dataclass
class RoundStats:
    """One decoding round.

    Attributes:
        accept_len: accepted draft tokens (bonus excluded).
        emitted: tokens this round added to the output (accept_len + 1 unless cut by a stop or
            by max_new_tokens).
        coverage: target coverage C_p of the round's tree (E[accept_len] it allowed; paper Eq. 6).
        tree_nodes: valid nodes of the tree, root included.
        stage_ms: wall milliseconds per stage (draft, build, tree_forward, verify, commit).
    """

    accept_len: int
    emitted: int
    coverage: float
    tree_nodes: int
    stage_ms: dict[str, float]


@dataclass
class GenerationResult:
    """Output of :meth:`SpeculativeGenerator.generate`.

    Attributes:
        token_ids: the new tokens (prompt excluded).
        text: ``tokenizer.decode(token_ids, skip_special_tokens=True)`` (EOS and other special
            tokens not shown, as HF and vLLM print them) when a tokenizer is known, else None.
        prompt_len: prompt tokens.
        finish_reason: ``"stop"`` (stop token or string), ``"length"`` (max_new_tokens) or
            ``"position_limit"`` (the model's max positions).
        rounds: per-round statistics.
        prefill_s: seconds spent on the prefill.
        decode_s: seconds spent in rounds.
    """

    token_ids: list[int]
    text: str | None
    prompt_len: int
    finish_reason: str
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per round (accept_len + 1, or what a truncated round emitted)."""
        return sum(r.emitted for r in self.rounds) / max(1, len(self.rounds))

    @property
    def accept_len_mean(self) -> float:
        return sum(r.accept_len for r in self.rounds) / max(1, len(self.rounds))

    @property
    def coverage_mean(self) -> float:
        return sum(r.coverage for r in self.rounds) / max(1, len(self.rounds))

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decoding (prefill excluded)."""
        return len(self.token_ids) / self.decode_s if self.decode_s > 0 else float("nan")

    def stage_ms(self) -> dict[str, float]:
        """Total milliseconds per stage over all rounds."""
        return {s: sum(r.stage_ms.get(s, 0.0) for r in self.rounds) for s in STAGES}


def cache_kwarg_name(model) -> str:
    """The KV-cache keyword of ``model.forward``: ``cache`` where transformers has renamed it
    (the signature says so; 5.2x), else ``past_key_values`` (which newer releases accept only
    until their removal)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{cache_kwarg_name(model): cache}``, to pass a KV cache to ``model(...)``."""
    return {cache_kwarg_name(model): cache}


def _quiet_cache_rename(fn):
    """transformers >= 5.2x renames ``past_key_values``; :func:`cache_kwarg_name` passes the new
    name when ``forward`` declares it. A forward that hides it behind ``**kwargs`` still gets the
    old one, whose FutureWarning on every forward would break the CLI's one-line stderr contract."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*", category=FutureWarning)
            return fn(*args, **kwargs)

    return wrapper


def _path_error(name: str, path) -> None:
    if path is None or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path, got {path!r}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{name}: no model directory at {os.fspath(path)!r}")


class SpeculativeGenerator:
    """Tree speculative decoding over a transformers causal LM.

    Args:
        target: an HF causal LM (Qwen3 / Llama families; anything taking ``position_ids``, a 4-D
            additive ``attention_mask`` and a ``DynamicCache``). Put in eval mode here.
        drafter: a :class:`~sglang_tev.hf.drafters.Drafter` (e.g. ``DFlashDrafter``), or None for
            autoregressive decoding only.
        tokenizer: optional HF tokenizer (text prompts, stop strings, EOS, decoded output).

    Raises:
        ValueError: a DFlash drafter that does not fit the target (hidden size, vocabulary,
        target_layer_ids, mask token) — checked by the drafter's config.
    """

    def __init__(self, target, drafter=None, tokenizer=None) -> None:
        self.target = target.eval()
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.config = target.config
        self._cache_kw = cache_kwarg_name(target)  # resolved once: signature inspection is not free
        self.device = next(target.parameters()).device
        model = getattr(drafter, "model", None)
        if model is not None and hasattr(model, "validate_against_target"):
            model.validate_against_target(self.config)
        self.cache = None
        self.committed: torch.Tensor | None = None
        self.past_len = 0

    # ------------------------------------------------------------------ loading
    @classmethod
    @shipped_pair_default  # target None / "tiny-code": the shipped pair; no progress bars while loading
    def from_pretrained(
        cls,
        target: str | os.PathLike | None = None,
        draft: str | os.PathLike | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> "SpeculativeGenerator":
        """Load a target (HF directory with tokenizer) and a z-lab DFlash drafter from disk.

        Args:
            target: directory of the target model and its tokenizer; None or ``"tiny-code"``: the
                pair shipped in the package (hf/assets.py), its drafter too unless ``draft`` is
                given (``draft=False``: none).
            draft: directory of the DFlash drafter (z-lab layout), or None.
            dtype: default float32 on CPU, bfloat16 on CUDA.
            device: default CUDA when available, else CPU.
        Raises:
            FileNotFoundError / ValueError naming ``target`` or ``draft``; ValueError when the
            drafter does not fit the target or ``target`` is a DFlash drafter directory.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..draft.dflash import DFlashDraftModel, is_dflash_checkpoint
        from .drafters import DFlashDrafter

        _path_error("target", target)
        if draft is not None:
            _path_error("draft", draft)
        if is_dflash_checkpoint(target):
            raise ValueError(f"target: {os.fspath(target)!r} is a DFlash drafter (z-lab layout), not a target "
                             "model; pass it as the draft")
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
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
        return cls(model, drafter, tok)

    # ------------------------------------------------------------------ helpers
    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def vocab_size(self) -> int:
        return int(self.target.get_output_embeddings().weight.shape[0])

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

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _features(self, hidden_states) -> torch.Tensor | None:
        ids = getattr(self.drafter, "target_layer_ids", None)
        if not ids:
            return None
        return torch.cat([hidden_states[i + 1] for i in ids], dim=-1)

    def _stop_ids(self, stop_token_ids, ignore_eos: bool) -> set[int]:
        stops = set(int(t) for t in (stop_token_ids or []))
        if not ignore_eos:
            eos = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
            if eos is None and self.tokenizer is not None:
                eos = self.tokenizer.eos_token_id
            if eos is None:
                eos = getattr(self.config, "eos_token_id", None)
            if isinstance(eos, int):
                stops.add(eos)
            elif eos is not None:
                stops.update(int(e) for e in eos)
        return stops

    # ------------------------------------------------------------------ generation
    @_quiet_cache_rename
    @torch.inference_mode()
    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        *,
        method: str = "tev",
        budget: int = 64,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        max_new_tokens: int = 256,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] | None = None,
        ignore_eos: bool = False,
        block_size: int | None = None,
        verifier: str = "tev",
        chat_template: bool = True,
        stream: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt``.

        Args:
            prompt: text (needs a tokenizer; chat template applied when ``chat_template`` and the
                tokenizer has one) or token ids (list or int64 [L] / [1, L]).
            method: one of :data:`GENERATION_METHODS`.
            budget: DDTree budget B (non-root nodes), >= 0.
            sampling: the target law (default greedy: temperature 0).
            seed: seed of the verifier's uniforms.
            max_new_tokens: >= 1; never exceeded.
            stop_token_ids: extra stop tokens; EOS is one unless ``ignore_eos``.
            stop_strings: the output is cut right after the token that completes one of them.
            block_size: K (default: the drafter's); a round drafts at most K - 1 depths.
            verifier: the verifier of ``chain`` (``tev`` / ``predraw`` / ``sequential`` / ``greedy``).
            stream: called with each round's emitted token ids (after stop handling).

        Returns:
            :class:`GenerationResult`. The KV cache and committed tokens stay on the generator
            (``self.cache``, ``self.committed``, ``self.past_len``) until the next call.

        Raises:
            ValueError naming the argument: unknown method or verifier, budget < 0,
            max_new_tokens < 1, empty prompt or one longer than the position limit, block_size out
            of range, a speculative method without a drafter, invalid sampling values.

        Exactness: every method's output has the law of plain sampling from the processed target
        law (greedy: token-identical to plain greedy decoding).
        """
        sampling = SamplingParams(temperature=0.0) if sampling is None else sampling
        if method not in GENERATION_METHODS:
            raise ValueError(f"method must be one of {GENERATION_METHODS}, got {method!r}")
        if verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {VERIFIERS}, got {verifier!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budget must be an int >= 0, got {budget!r}")
        if budget > MAX_BUDGET:
            raise ValueError(f"budget must be <= {MAX_BUDGET} (the builder holds budget x min(budget, V) candidates), got {budget}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        sampling.validate(1)
        check_verifier = method if method in VERIFIERS else verifier
        if check_verifier == "greedy" and not sampling.all_greedy():
            raise ValueError("verifier 'greedy' is exact only at temperature < 1e-5; use tev, predraw or sequential")
        speculative = method != "autoregressive"
        if speculative and self.drafter is None:
            raise ValueError(f"method {method!r} needs a drafter; load one or use method='autoregressive'")
        K = None
        if speculative:
            K = self.drafter.block_size if block_size is None else block_size
            if isinstance(K, bool) or not isinstance(K, int) or not 2 <= K <= self.drafter.block_size:
                raise ValueError(f"block_size must be an int in [2, {self.drafter.block_size}], got {block_size!r}")
        if stop_strings is not None:
            if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
                raise ValueError("stop_strings must be a list of non-empty strings")
            if self.tokenizer is None:
                raise ValueError("stop_strings need a tokenizer")

        if isinstance(prompt, str):
            ids = self.encode(prompt, chat_template)
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.reshape(-1).tolist()
        else:
            ids = [int(t) for t in prompt]
        if len(ids) == 0:
            raise ValueError("prompt must hold at least one token")
        if len(ids) > self.max_positions:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the model's {self.max_positions} positions")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")

        from transformers import DynamicCache

        dev = self.device
        stops = self._stop_ids(stop_token_ids, ignore_eos)
        gen = torch.Generator(device=dev).manual_seed(seed)
        need_feats = speculative and bool(getattr(self.drafter, "target_layer_ids", None))
        if speculative:
            self.drafter.reset()
        self.cache = DynamicCache(config=self.config)
        self.committed = torch.tensor([ids], dtype=torch.int64, device=dev)
        self.past_len = len(ids) - 1
        pending: list[torch.Tensor] = []  # target features not yet given to the drafter

        t0 = time.perf_counter()
        if self.past_len > 0:
            out = self.target(
                self.committed[:, :-1],
                **{self._cache_kw: self.cache},
                use_cache=True,
                output_hidden_states=need_feats,
                logits_to_keep=1,
            )
            if need_feats:
                pending.append(self._features(out.hidden_states))
        self._sync()
        result = GenerationResult([], None, len(ids), "length", prefill_s=time.perf_counter() - t0)
        mask_dtype = self.target.dtype if self.target.dtype.is_floating_point else torch.float32

        t_dec = time.perf_counter()
        first_call = True
        while len(result.token_ids) < max_new_tokens:
            remaining = max_new_tokens - len(result.token_ids)
            room = self.max_positions - 1 - self.past_len  # deepest position a node may take
            if room < 0:
                result.finish_reason = "position_limit"
                break
            times = {}
            t = time.perf_counter()
            root = self.committed[:, -1]
            H = 0 if not speculative else min(K - 1, remaining - 1, room)
            draft_logits = None
            if H > 0:
                feats = torch.cat(pending, 1) if pending else None
                pending = []
                draft_logits = self.drafter.draft(self.committed, feats, H)
            self._sync()
            times["draft"] = time.perf_counter() - t

            t = time.perf_counter()
            if draft_logits is None:
                tree = DraftTree.from_parents(torch.full((1, 1), -1, dtype=torch.int64, device=dev), root.view(1, 1), validate=False)
            elif method == "chain":
                chain = draft_logits.argmax(-1)  # [1, H]
                parents = torch.arange(-1, H, device=dev).view(1, H + 1)
                tree = DraftTree.from_parents(parents, torch.cat([root.view(1, 1), chain], 1), validate=False)
            else:
                tree = build_ddtree(draft_logits, budget, root, validate=first_call)
            self._sync()
            times["build"] = time.perf_counter() - t

            t = time.perf_counter()
            n = tree.num_nodes
            positions = tree.depth + self.past_len
            mask = tree_attention_mask(tree, self.past_len, dtype=mask_dtype)
            out = self.target(
                tree.tokens,
                position_ids=positions,
                attention_mask=mask,
                **{self._cache_kw: self.cache},
                use_cache=True,
                output_hidden_states=need_feats,
            )
            self._sync()
            times["tree_forward"] = time.perf_counter() - t

            t = time.perf_counter()
            vmethod = method if method in VERIFIERS else verifier
            vout = verify_tree(tree, out.logits.float(), method=vmethod, sampling=sampling, generator=gen, validate=first_call)
            acc = int(vout.accept_len[0])  # the one host sync of the round
            self._sync()
            times["verify"] = time.perf_counter() - t
            first_call = False

            t = time.perf_counter()
            path = vout.path[0, : acc + 1]
            self._commit_kv(path, n)
            if need_feats:
                pending.append(self._features(out.hidden_states)[:, path])
            block = tree.tokens[0, path[1:]].tolist() + [int(vout.bonus[0])]
            block, reason = self._cut(block, result.token_ids, stops, stop_strings, remaining)
            self.committed = torch.cat([self.committed, torch.tensor([block], dtype=torch.int64, device=dev)], 1)
            self.past_len += acc + 1
            result.token_ids.extend(block)
            self._sync()
            times["commit"] = time.perf_counter() - t
            result.rounds.append(
                RoundStats(acc, len(block), float(vout.coverage[0]), int(tree.valid.sum()), {k: v * 1e3 for k, v in times.items()})
            )
            if stream is not None and block:
                stream(block)
            if reason is not None:
                result.finish_reason = reason
                break
        result.decode_s = time.perf_counter() - t_dec
        if self.tokenizer is not None:
            result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return result

    def _commit_kv(self, path: torch.Tensor, n: int) -> None:
        """Keep the accepted nodes' KV rows: gather them to the front of the tree window, crop."""
        start = self.past_len
        keep = path.numel()
        src = path + start
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                buf = getattr(layer, name)
                # the gather copies first, so overlapping source and destination are safe
                buf[:, :, start : start + keep] = buf[:, :, src]
        if n > keep:  # drop the rejected rows (transformers 5: crop takes a negative count)
            self.cache.crop(-(n - keep))

    def _cut(self, block, so_far, stops, stop_strings, remaining):
        """Cut a round's block at the first stop token / stop string (inclusive) and at the budget."""
        reason = None
        if len(block) >= remaining:
            block = block[:remaining]
            reason = "length"
        for i, tok in enumerate(block):
            if tok in stops:
                return block[: i + 1], "stop"
        if stop_strings:
            base = len(so_far)
            full = so_far + block
            # Decode only a window of recent tokens: an occurrence completed by token i ends in
            # it, and a character spans at most 4 byte-level tokens, so 4 * len + 8 tokens cover
            # it with room at the left edge (where a partial character or a tokenizer's stripped
            # leading space may differ from the full decode). Earlier occurrences would have
            # stopped earlier rounds. Cost per token: O(longest stop string), not O(output).
            window = 4 * max(len(s) for s in stop_strings) + 8
            for i in range(len(block)):
                end = base + i + 1
                text = self.tokenizer.decode(full[max(0, end - window): end], skip_special_tokens=False)
                if any(s in text for s in stop_strings):
                    return block[: i + 1], "stop"
        return block, reason
