"""Compiling a built model from outside (torch.compile with graphs of its own, a progress line while it
compiles) and how a compiled graph runs its matrix products (`gemm`). Used by StaticTarget and the
drafter's compiled round; nothing here changes what is computed."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch


def allow_recompiles(n: int) -> None:
    """torch.compile keeps up to dynamo's recompile limit (8 by default) of graphs per code object, then
    runs the function eager; a compiled step or round adds a graph per shape that specialises. Raise
    the limit to at least n."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), n))


def compile_own(method: Callable, **kwargs: Any) -> Callable:
    """torch.compile(method, **kwargs) with graphs of its own. torch.compile keeps its graphs per code
    object, which every instance of a class shares for a compiled method (StaticTarget's step, a
    drafter's round), and each call checks the guards of the graphs cached before the one it runs: with
    a few instances of a few graphs each, that check alone took longer than a step's arithmetic
    (docs/architecture.md, "Performance choices"). The method's function is given a copy of its code
    object, so this instance's graphs are the only ones its calls check."""
    import types

    func = method.__func__
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__, own.__qualname__ = func.__kwdefaults__, func.__qualname__
    return torch.compile(types.MethodType(own, method.__self__), **kwargs)


def announce_compiling(what: str) -> Callable[[], None]:
    """On a terminal, say that `what` is being compiled (a first compiled call can take minutes and
    looks like a hang); returns the function that says it is done, with the time. Off a terminal
    (logs, pipes, tests) both are silent."""
    import sys
    import time

    if not sys.stderr.isatty():
        return lambda: None
    print(f"compiling {what} (torch.compile: the first calls take from seconds to a few minutes)...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    return lambda: print(f"compiled {what} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


GEMMS = ("auto", "inductor", "aten")


def gemm_choice(gemm: str, devices) -> str:
    """How a compiled graph runs its matrix products (a `gemm` option): "inductor", inductor's own C++
    GEMM kernels over the weights frozen into the graph (`inductor_gemm`); "aten", calls to the
    library's kernels (oneDNN, MKL, cuBLAS), the weights read as inputs. "auto": "inductor" where every
    device in `devices` is the CPU, where a small model's products cost more in each library call's
    overhead than in arithmetic (docs/architecture.md, "Performance choices"); else "aten"."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
    if gemm == "auto":
        return "inductor" if all(torch.device(d).type == "cpu" for d in devices) else "aten"
    return gemm


@contextlib.contextmanager
def inductor_gemm(gemm: str):
    """The context a graph compiles in for a resolved `gemm` (gemm_choice): for "inductor", inductor's
    configuration that freezes the module parameters the graph reads into it as constants (inference
    only: a graph does not see later changes to them) and chooses each matrix product, by timing, among
    inductor's C++ GEMM templates (the weight packed at compile time for AMX or AVX-512 microkernels)
    and ATen's call; for "aten", nothing."""
    import torch._inductor.config as inductor_config

    if gemm != "inductor":
        yield
        return
    with inductor_config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN",
                               autotune_num_choices_displayed=0,  # (the timings, printed by default)
                               max_autotune_report_choices_stats=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # (autotuning reads storages so)
        yield
