"""Stop a server when the process that launched it dies: the child's half of `tandem up`'s supervision.

`tandem up` must never orphan a tier, however it dies (even SIGKILL). Linux's parent-death signal does
that, but it has to be set in the child. Setting it from the parent with a `preexec_fn` forces a plain
fork of a process whose gRPC threads are running, and gRPC's fork handlers then abort either process
now and then (`ev_epoll1_linux.cc … ConsumeWakeup`). So the launcher only names itself in an environment
variable, spawns without a pre-exec hook, and the child arms the signal here, first thing.
"""

from __future__ import annotations

import logging
import os
import signal

from base.settings import get_settings

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def stop_with_parent() -> None:
    """When `TANDEM_PARENT_PID` names our parent, get SIGTERM when it dies (Linux; elsewhere a no-op).

    The parent may already be gone by the time we run: then our parent pid is no longer it, and we stop
    at once rather than serve with nobody to stop us.
    """
    expected = get_settings().parent_pid
    if expected is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        logger.warning("no parent-death signal on this platform; the launcher must stop this server")
        return
    if os.getppid() != expected:
        os.kill(os.getpid(), signal.SIGTERM)
