"""Stand-in for sgl-kernel, whose CPU build is not on the package registry.

sglang imports ``sgl_kernel`` at module level, but on a CPU without AMX with the
``torch_native`` attention backend nothing calls it. Every attribute is a function that
raises if it is ever called, so a code path that does need the real kernels fails loudly.
Installed by scripts/setup_live_engine.sh into the SGLang test venv only (never into a
user's environment). Adapted from the project's CPU recipe (live_sglang_cpu.sh).
"""

__version__ = "0.0.0+stand-in"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} called (stand-in, no CPU build)")

    _missing.__name__ = name
    return _missing
