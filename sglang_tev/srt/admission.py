"""Per-request admission checks of a TEV server (imports sglang only inside the hook).

TEV's guarantee is that each request's output is distributed exactly as plain decoding of the
target with that request's sampling parameters. Options whose effect depends on the tokens
generated so far cannot be applied exactly by one adjustment per request on a whole tree: the
history differs along each tree path. (SGLang 0.5.23's own DFLASH verify drops them after the
first token altogether, measured on CPU: ``apply_dflash_verify_logits_adjustments`` reads
``acc_linear_penalties``, which ``SamplingBatchInfo`` does not carry, and the forward copy of the
batch has no penalizer; its output with penalties equals its output without.) Until TEV keeps
these counts along each tree path itself, such requests are refused at admission, with one ``ValueError`` naming the option: SGLang's HTTP layer answers it with a 400,
``Engine.generate`` raises it, and the server keeps serving everything else.

Served exactly (not refused): temperature, top-k, top-p, min-p, ``sampling_seed``, ``logit_bias``
(the same at every node), stop strings / ids, ``ignore_eos``, ``max_new_tokens``, ``n``,
``return_logprob`` / top logprobs, ``regex`` / ``json_schema`` / ``ebnf`` grammars (a per-node
vocabulary mask from the grammar state along each tree path). Refused at start-up instead
(``config.validate_server_args``): custom logit processors, hidden-state return, LoRA.
"""

from __future__ import annotations

from typing import Mapping, Optional

__all__ = ["PATH_DEPENDENT_OPTIONS", "check_sampling_params", "install_admission_hook"]

PATH_DEPENDENT_OPTIONS = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}
"""Sampling options (with their no-op value) whose adjustment depends on the generated tokens."""

_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_installed = False


def check_sampling_params(sampling_params: Optional[Mapping]) -> None:
    """Refuse a request's path-dependent sampling options (see the module docstring).

    Args:
        sampling_params: the request's ``sampling_params`` dict (None = defaults).
    Raises:
        ValueError naming the first option set to anything but its no-op value.
    """
    if not sampling_params:
        return
    for name, neutral in PATH_DEPENDENT_OPTIONS.items():
        value = sampling_params.get(name)
        if value is not None and value != neutral:
            raise ValueError(
                f"TEV: sampling parameter {name}={value!r} is not supported by --speculative-algorithm TEV: its effect "
                f"depends on the tokens generated so far, which differ along each draft-tree path, so it cannot be "
                f"applied exactly yet; send {name}={neutral!r} (or omit it), or serve without speculative decoding"
            )


def _after_validate(result, manager, obj, *args, **kwargs):
    server_args = getattr(manager, "server_args", None)
    if str(getattr(server_args, "speculative_algorithm", None) or "").upper() != "TEV":
        return result
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, Mapping):
        check_sampling_params(params)
    return result


def install_admission_hook() -> None:
    """Register :func:`check_sampling_params` after SGLang's own per-request validation
    (``TokenizerManager._validate_one_request``, ``managers/tokenizer_manager.py:1307``, which runs
    for ``/generate``, the OpenAI endpoints and ``Engine.generate``) through SGLang's
    ``HookRegistry``; ``load_plugins()`` applies it. Idempotent. Servers running another
    algorithm are not affected."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, _after_validate, HookType.AFTER)
    _installed = True
