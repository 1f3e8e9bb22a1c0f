"""The transformers runtime: the generator (runtime.py), its scheduler and round, masks, stops, the static KV cache, the DFlash runner, bench and the CLI's data helpers."""
