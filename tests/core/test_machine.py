"""``sglang_tev.machine``: the fields a measurement records about its machine."""

from __future__ import annotations

import io
import os

import pytest

from sglang_tev import machine
from sglang_tev.machine import cpu_bf16_flags, machine_info


def _cpuinfo(monkeypatch, text: str | None):
    def fake_open(path, *a, **k):
        assert path == "/proc/cpuinfo"
        if text is None:
            raise OSError("no cpuinfo here")
        return io.StringIO(text)

    monkeypatch.setattr(machine, "open", fake_open, raising=False)  # the module's `open`, not builtins'


@pytest.mark.parametrize("text,want", [
    ("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
     "flags\t\t: fpu\n", ["amx_bf16", "avx512_bf16"]),  # the first flags line; only the bf16 ones
    ("model name\t: AMD EPYC\nflags\t\t: fpu sse4_2 avx2 fma\n", []),
    ("model name\t: no flags line\n", []),
    (None, []),
])
def test_cpu_bf16_flags(monkeypatch, text, want):
    _cpuinfo(monkeypatch, text)
    assert cpu_bf16_flags() == want
    assert machine_info("cpu_bf16") == {"cpu_bf16": want}


def test_fields_and_renamed_keys():
    got = machine_info("cpu_count", threads="cpu_count")
    assert got == {"cpu_count": os.cpu_count(), "threads": os.cpu_count()}
    with pytest.raises((KeyError, ValueError)):
        machine_info("no_such_field")
