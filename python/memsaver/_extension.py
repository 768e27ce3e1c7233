"""Whether memsaver's compiled extension (``memsaver._memsaver``) imports in this Python.

Everything in the package needs the extension (it holds the bindings of libmemsaver.so) but this
module, the package's ``__init__`` and :func:`memsaver.vllm.register`. A missing or broken one (a
source checkout on ``PYTHONPATH``, a wheel built for another Python) must not make the package's
import fail with Python's "cannot import name '_memsaver' from partially initialized module
'memsaver' (most likely due to a circular import)": vLLM imports every installed plugin in each of
its processes and logs that line, then runs without memsaver. So the package imports without it;
every use of the package then raises :func:`missing`'s error, which says what is missing and how
to install it, and ``memsaver.vllm.register`` raises it when vLLM was asked to run on memsaver.

This module imports nothing of the package (the extension by name, to keep its own error).
"""

from __future__ import annotations

import importlib
import sys

#: The extension's module.
MODULE = __name__.rpartition(".")[0] + "._memsaver"


def _probe() -> ImportError | None:
    # By name: `from . import _memsaver` in a package still initializing would replace the real
    # cause (no such module, an undefined symbol) by "most likely due to a circular import".
    try:
        importlib.import_module(MODULE)
    except ImportError as e:
        return e
    return None


#: Why the extension does not import here, or None when it does.
ERROR: ImportError | None = _probe()


def missing(what: str) -> ImportError:
    """The error of ``what``, which needs the extension that does not import here (the cause,
    :data:`ERROR`, in its message)."""
    python = f"{sys.executable}, Python {sys.version_info[0]}.{sys.version_info[1]}"
    return ImportError(
        f"{what}: memsaver's compiled extension ({MODULE}, the bindings of libmemsaver.so) is "
        f"missing or does not load in this Python ({python}): {ERROR}. Install memsaver's wheel "
        "into this environment (pip install memsaver; from a source checkout: make python, or "
        "pip install ./python): a source checkout on PYTHONPATH has no extension.",
        name=MODULE,
    )
