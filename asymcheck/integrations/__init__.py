"""What the framework integrations share (``asymcheck.accelerate``, ``.hf``, ``.lightning``).

- :mod:`~asymcheck.integrations.position`: :class:`LoaderPosition` and the :class:`ResumableLoader` base;
- :mod:`~asymcheck.integrations.rng`: the RNG states a pass begins with, a version's states held to put back;
- :mod:`~asymcheck.integrations.support`: the supported-settings check with the tested-version rule;
- :mod:`~asymcheck.integrations.settings`: the refused settings of each framework, and why (data);
- :mod:`~asymcheck.integrations.callback`: the deferred checkpointer a callback drives;
- :mod:`~asymcheck.integrations.names`: the reserved names of the integrations' state in a version.

Nothing here imports a framework; a framework module holds only what its framework needs.
"""

from asymcheck.integrations.callback import DeferredCheckpointer
from asymcheck.integrations.position import LoaderPosition, ResumableLoader
from asymcheck.integrations.rng import HeldRng, pass_states, set_pass_states
from asymcheck.integrations.settings import Refusal
from asymcheck.integrations.support import require_supported, untested_version

__all__ = ["DeferredCheckpointer", "HeldRng", "LoaderPosition", "Refusal", "ResumableLoader", "pass_states",
           "require_supported", "set_pass_states", "untested_version"]
