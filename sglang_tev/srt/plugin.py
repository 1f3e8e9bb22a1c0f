"""SGLang plugin entry point: ``sglang.srt.plugins`` → ``tev = "sglang_tev.srt.plugin:register"``.

SGLang's ``load_plugins()`` calls :func:`register` once in every process it starts (launcher,
scheduler, DP controller, detokenizer). It registers ``--speculative-algorithm TEV``; the worker
module (heavy: the DFlash V2 worker) is imported only when the scheduler asks for the worker class.
"""

from __future__ import annotations

__all__ = ["register", "ALGORITHM_NAME"]

ALGORITHM_NAME = "TEV"


def register() -> None:
    """Register ``TEV`` with ``SpeculativeAlgorithm``; idempotent (a second call does nothing).

    Raises:
        ImportError when sglang is not installed (``pip install "sglang-tev[sglang]"``).
    """
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM_NAME) is not None:
        return
    from .algo import TevAlgo
    from .config import validate_server_args

    @SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        supports_overlap=False,
        validate_server_args=validate_server_args,
        spec_class=TevAlgo,
    )
    def _worker_class(server_args):
        from .worker import TEVWorker

        return TEVWorker
