"""The process's open-file limit: raised at start, so connections do not run a server out of descriptors.

Every client connection holds a descriptor, and so does every model file, socket and pipe. At the common
soft limit of 1,024, a thousand half-open HTTP connections took every descriptor and a new gRPC client
could not connect. The soft limit may be raised up to the hard one without privileges.
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
            return soft
        logger.info("raised the open-file limit from %d to %d", soft, target)
        return target
    return soft


def open_file_limit() -> int:
    """The soft RLIMIT_NOFILE (a large number when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
