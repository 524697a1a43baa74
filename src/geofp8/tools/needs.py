"""The optional packages a command needs, checked before it starts work: a missing one ends
the command with one line naming what to install, not a traceback minutes later in a rank.

The core (``geofp8``'s hooks, FSDP2 reductions, codecs) needs only torch and numpy; the tools
train Hugging Face Llamas on a BPE corpus and draw their reports with matplotlib.
"""

from __future__ import annotations

import importlib.util

from .errors import UsageError

__all__ = ["EXTRAS", "available", "install_hint", "require"]

# package -> the extra of pyproject.toml that installs it
EXTRAS = {"transformers": "hf", "tokenizers": "hf", "datasets": "hf", "matplotlib": "report",
          "gguf": "gguf"}


def available(module: str) -> bool:
    """Whether ``import module`` can find it (without importing it)."""
    return importlib.util.find_spec(module) is not None


def install_hint(modules: list[str]) -> str:
    """``pip install a b (the [x] extra)``."""
    extras = sorted({f"[{EXTRAS[m]}]" for m in modules if m in EXTRAS})
    return (f"pip install {' '.join(modules)}"
            + (f" (the {' and '.join(extras)} extra{'s' if len(extras) > 1 else ''} of "
               "geofp8)" if extras else ""))


def require(what: str, *modules: str) -> None:
    """Raise :class:`UsageError` naming the ``modules`` that ``what`` needs and that are not
    installed."""
    missing = [m for m in modules if not available(m)]
    if missing:
        raise UsageError(f"{what} needs {', '.join(missing)}, not installed here: "
                         f"{install_hint(missing)}")
