"""Per-request options of a TEV server: the admission check and the scheduler hook that serves
penalties (imports sglang only inside the hooks).

TEV's guarantee is that each request's output is distributed exactly as plain decoding of the
target with that request's sampling parameters. Every per-request option SGLang 0.5.23 accepts is
served exactly today, so :data:`REFUSED_OPTIONS` is empty; the check stays for any option that
cannot be (one ``ValueError`` naming the option: SGLang's HTTP layer answers it with a 400,
``Engine.generate`` raises it, and the server keeps serving everything else). Prompts SGLang
accepts but cannot run (empty, or with an id outside the vocabulary: its scheduler exits on them)
are refused the same way (:func:`check_input_ids`).

Served exactly: temperature, top-k, top-p, min-p, ``sampling_seed``, ``logit_bias`` (the same at
every node), stop strings / ids, ``ignore_eos``, ``max_new_tokens``, ``n``, ``return_logprob`` /
top logprobs, ``regex`` / ``json_schema`` / ``ebnf`` grammars (a per-node vocabulary mask from the
grammar state along each tree path), and ``frequency_penalty``, ``presence_penalty``,
``repetition_penalty``, ``min_new_tokens`` (recomputed at every node from SGLang's committed
penalty state plus the node's path: ``srt/penalties.py``, whose hook :func:`install_admission_hook`
also installs). Refused at start-up instead (``config.validate_server_args``): custom logit
processors, hidden-state return, LoRA.
"""

from __future__ import annotations

from typing import Mapping, Optional

__all__ = [
    "REFUSED_OPTIONS",
    "check_sampling_params",
    "check_input_ids",
    "check_deterministic_min_p",
    "install_admission_hook",
]

REFUSED_OPTIONS: dict = {}
"""Sampling options TEV cannot serve exactly, ``{name: (no-op value, reason)}``; a request setting
one to anything but its no-op value is refused. Empty: penalties and ``min_new_tokens``, the last
entries, are served."""

_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_installed = False


def check_sampling_params(sampling_params: Optional[Mapping], refused: Optional[Mapping] = None) -> None:
    """Refuse a request's options that TEV cannot serve exactly (see the module docstring).

    Args:
        sampling_params: the request's ``sampling_params`` dict (None = defaults).
        refused: ``{name: (no-op value, reason)}``; default :data:`REFUSED_OPTIONS`.
    Raises:
        ValueError naming the first refused option set to anything but its no-op value.
    """
    refused = REFUSED_OPTIONS if refused is None else refused
    if not sampling_params:
        return
    for name, (neutral, reason) in refused.items():
        value = sampling_params.get(name)
        if value is not None and value != neutral:
            raise ValueError(
                f"TEV: sampling parameter {name}={value!r} is not supported by --speculative-algorithm TEV: {reason}; "
                f"send {name}={neutral!r} (or omit it), or serve without speculative decoding"
            )


def check_input_ids(input_ids, vocab_size: int) -> None:
    """Refuse a prompt that would take the scheduler down instead of getting an answer.

    SGLang 0.5.23 accepts both and then raises inside the scheduler, which exits (every request in
    flight lost): an empty prompt fails in the prefill's logits pruning
    (``layers/logits_processor.py:723``, index into an empty batch) and an id outside the
    vocabulary in the target's embedding (``IndexError``). Found by sending them to a TEV server.

    Args:
        input_ids: the request's token ids after tokenization (None: an embeddings request, not
            checked here).
        vocab_size: the target's vocabulary size.
    Raises:
        ValueError naming the problem (SGLang answers it with HTTP 400).
    """
    if input_ids is None:
        return
    if len(input_ids) == 0:
        raise ValueError("TEV: the prompt is empty (no input token): send at least one token")
    bad = next((t for t in input_ids if not 0 <= int(t) < int(vocab_size)), None)
    if bad is not None:
        raise ValueError(f"TEV: input_ids contains the out-of-vocabulary token id {bad}; valid range is [0, {vocab_size})")


def check_deterministic_min_p(sampling_params: Optional[Mapping], deterministic: bool) -> None:
    """Refuse min-p on a server started with ``--enable-deterministic-inference``.

    There every request carries a sampling seed, and SGLang 0.5.23's seeded sampler asserts on
    min-p (``layers/sampler.py:829-833``, "With sampling seed, multinomial_with_seed will provide
    wrong results") when it samples the request's first token in the prefill, for plain decoding
    and every speculative algorithm alike: the scheduler exits and every request in flight is
    lost. Found by sending one to a TEV server; TEV itself serves min-p exactly.

    Args:
        sampling_params: the request's ``sampling_params`` dict (None = defaults).
        deterministic: the server's ``enable_deterministic_inference``.
    Raises:
        ValueError naming ``min_p`` and the flag (HTTP 400 on a server).
    """
    if not deterministic or not sampling_params:
        return
    min_p = sampling_params.get("min_p")
    if min_p is not None and float(min_p) > 0.0:
        raise ValueError(
            f"TEV: min_p={min_p!r} with --enable-deterministic-inference: SGLang's seeded sampler does not support "
            "min-p (layers/sampler.py:831; its scheduler would exit); send min_p=0, or serve min-p without "
            "deterministic inference"
        )


def _after_validate(result, manager, obj, *args, **kwargs):
    server_args = getattr(manager, "server_args", None)
    if str(getattr(server_args, "speculative_algorithm", None) or "").upper() != "TEV":
        return result
    input_ids = args[0] if args else kwargs.get("input_ids")
    if getattr(obj, "input_embeds", None) is None:
        check_input_ids(input_ids, manager.model_config.vocab_size)
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, Mapping):
        check_sampling_params(params)
        check_deterministic_min_p(params, bool(getattr(server_args, "enable_deterministic_inference", False)))
    return result


def install_admission_hook() -> None:
    """Install, through SGLang's ``HookRegistry`` (``load_plugins()`` applies them; idempotent):

    * :func:`check_input_ids`, :func:`check_sampling_params` and :func:`check_deterministic_min_p`
      after SGLang's own per-request
      validation (``TokenizerManager._validate_one_request``, ``managers/tokenizer_manager.py:1307``,
      which runs for ``/generate``, the OpenAI endpoints and ``Engine.generate``). Servers running
      another algorithm are not affected.
    * the penalizer hook that lets the TEV worker read and feed SGLang's penalty state
      (:func:`sglang_tev.srt.penalties.install_penalizer_hook`)."""
    global _installed
    if _installed:
        return
    from .penalties import install_penalizer_hook

    install_penalizer_hook()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, _after_validate, HookType.AFTER)
    _installed = True
