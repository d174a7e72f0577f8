"""The doctor's checks, one module per check-id prefix, in one registry.

A check is a function decorated with :func:`check`; its docstring is the long text ``--explain``
prints. It declares its phase: ``host`` checks run first; then the pair verdicts are computed
(``p2phub.doctor.pairs``); then the ``pairs`` checks run, which read ``ctx.pairs``. Each check runs
once, and the report lists the checks in registration order (the order of the area modules imported
at the bottom of this file, then the order within each module), whatever their phase.
"""

from __future__ import annotations

from .base import (CMDLINE_KEYS, EXPLAIN, KALLSYMS_NEEDLES, KCONFIG_KEYS, PHASES, REGISTRY,  # noqa: F401
                   CheckFn, Context, R, check, cmdline_tokens, endpoints, load_kconfig)

# The area modules register their checks on import; this order is the report's order.
from . import host, kernel, iommu, pcie, gpu, nvme, nic, kmod, pairs  # noqa: E402,F401
