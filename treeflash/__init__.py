"""treeflash: lossless speculative decoding with TreeFlash trees over a DFlash block drafter."""
from .errors import TreeflashError

__version__ = "0.1.0"
__all__ = ["load", "Engine", "GenerationConfig", "TreeflashError", "__version__"]


def __getattr__(name):  # keep `import treeflash` light; torch loads on first use
    if name in ("load", "Engine", "Result", "random_drafter"):
        from . import api
        return getattr(api, name)
    if name == "GenerationConfig":
        from .config import GenerationConfig
        return GenerationConfig
    raise AttributeError(name)
